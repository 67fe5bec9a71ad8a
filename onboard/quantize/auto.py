"""`scheme: auto`: per-group formats under a bits budget, chosen by measured end-to-end KL."""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from onboard.console import console
from onboard.evaluate.replay import LayerReplay
from onboard.quantize.compose import Composer
from onboard.quantize.groups import Group, decision_groups, effective_bits
from onboard.quantize.knapsack import additive_selection, check_budget, predicted_kl
from onboard.quantize.modifiers import prepared_copy, quantized_copy
from onboard.quantize.offloaded import is_offloaded
from onboard.quantize.schemes import LADDERS
from onboard.quantize.search import Measurer, measured_search
from onboard.quantize.sensitivity import fisher_sensitivity, measured_sensitivity, rank_correlation
from onboard.recipes import Method, Quantize


def search_windows(dataset: Dataset, tokens: int) -> torch.Tensor:
    """The first calibration windows holding about `tokens` tokens, as [n, T]."""
    ids = torch.tensor(dataset["input_ids"])
    count = min(len(ids), max(1, round(tokens / ids.shape[1])))
    return ids[:count, : min(ids.shape[1], tokens)]


def artifact_kld(replay: LayerReplay, artifact: Path) -> float:
    """The saved artifact's mean KL against the replay's reference on the search tokens, the artifact
    run one decoder layer at a time (`StreamedModel`).  A streamed quantize scores the artifact so,
    not its offloaded model: compressed-tensors 0.19's quantized forward fake-quantizes the weight
    it read, then runs the plain forward, which reads `self.weight` again, and offloading hands
    it a fresh copy of the unquantized weight."""
    from onboard.models.streamed import StreamedModel

    model = StreamedModel(artifact)
    hidden = model.final_hidden([replay.input_ids], "the artifact on the search tokens")[0]
    with torch.inference_mode():
        normed = model.norm()(hidden)
    return float(replay.kl(normed.reshape(-1, normed.shape[-1])).mean())


def pinned_patterns(groups: list[Group], assignment: dict[str, str], base: str) -> dict[str, list[str]]:
    """The recipe `formats:` block that reproduces `assignment` over a `base` scheme: one pattern
    per group kind and format, naming its layers (`layers\\.(1|4|7)\\.`)."""
    layers: dict[tuple[str, str], list[int]] = {}
    pinned: dict[str, list[str]] = {}
    for group in groups:
        fmt = assignment[group.name]
        if fmt == base:
            continue
        marker = f"layers\\.{group.layer}\\."
        if group.layer is None or marker not in group.pattern:
            pinned.setdefault(fmt, []).append(group.pattern)
            continue
        layers.setdefault((fmt, group.pattern.replace(marker, "layers\\.\0\\.", 1)), []).append(group.layer)
    for (fmt, template), indices in layers.items():
        alternatives = str(indices[0]) if len(indices) == 1 else "(" + "|".join(map(str, indices)) + ")"
        pinned.setdefault(fmt, []).append(template.replace("\0", alternatives))
    return {fmt: sorted(patterns) for fmt, patterns in sorted(pinned.items())}


FISHER_STREAMED = "not estimated on offloaded models: it needs a backward pass through the whole model"


class Selection:
    """Sources, groups and measurements of one model; `select(budget)` may be called for several
    budgets (the benchmark does), the sensitivities being measured once.

    `source(fmt)` makes the model with every target in `fmt`; by default `quantized_copy` of `model`
    in memory.  With `model` offloaded (`load_offloaded(linearized=False)`) and `offloaded_copy`
    sources, every measurement is the same, bit for bit, with one module's weights in memory at a
    time: the forwards read each module from disk as it runs (selection streamed).  The Fisher
    estimate, a diagnostic beside the measured sensitivities, is then left out."""

    def __init__(
        self,
        model,
        tokenizer,
        settings: Quantize,
        dataset: Dataset,
        budgets: list[float],
        source: Callable[[str], torch.nn.Module] | None = None,
    ) -> None:
        self.settings = settings
        self.ladder = LADDERS[settings.base]
        self.seconds: dict[str, float] = {}
        self.sources = {}
        if source is None:
            # Every copy and the BF16 groups share one smoothing and rotation, fused whole (norms,
            # embeddings, linears): modules of differently transformed models do not compose.
            clock = time.perf_counter()
            base = settings.model_copy(update={"scheme": settings.base})
            model, rest = prepared_copy(model, tokenizer, base, dataset)
            self.seconds["prepared"] = time.perf_counter() - clock

            def source(fmt: str) -> torch.nn.Module:
                return quantized_copy(model, tokenizer, rest, fmt, dataset)

        elif isinstance(settings.method, Method) and (settings.method.smoothing != "none" or settings.method.rotations):
            raise ValueError("a selection with smoothing or rotations makes its own sources (in memory)")
        self.model = model
        for fmt in self.ladder[:-1]:  # BF16 is the model itself
            clock = time.perf_counter()
            self.sources[fmt] = source(fmt)
            self.seconds[f"source:{fmt}"] = time.perf_counter() - clock
        self.seconds["sources"] = sum(self.seconds.values())
        self.groups = decision_groups(self.sources[settings.base])
        for budget in budgets:  # before the measuring, which is the long part
            check_budget(self.groups, settings.base, budget)
        self.replay = LayerReplay(self.model, search_windows(dataset, settings.search.tokens))
        self.composer = Composer(self.model, self.sources, self.groups)
        formats = [f for f in self.ladder if f != "bf16"]
        clock = time.perf_counter()
        console.print(f"sensitivity: {len(self.groups)} groups x {formats} on {self.replay.num_tokens} tokens")
        self.measured = measured_sensitivity(self.replay, self.composer, formats)
        self.seconds["sensitivity"] = time.perf_counter() - clock
        self.fisher_note = FISHER_STREAMED if is_offloaded(model) else None
        if self.fisher_note:
            self.fisher = {g.name: dict.fromkeys(formats) for g in self.groups}
        else:
            clock = time.perf_counter()
            self.fisher = fisher_sensitivity(self.replay, self.composer, formats)
            self.seconds["fisher"] = time.perf_counter() - clock

    def uniform(self) -> dict[str, str]:
        return {g.name: self.settings.base for g in self.groups}

    def select(self, budget: float, steps: int) -> tuple[dict[str, str], dict[str, Any]]:
        clock = time.perf_counter()
        start = additive_selection(self.groups, self.measured, self.ladder, budget)
        measurer = Measurer(self.replay, self.composer)
        final, trace = measured_search(measurer, self.groups, self.measured, self.ladder, budget, start, steps)
        seconds = {**self.seconds, "search": time.perf_counter() - clock}
        record = {
            "base": self.settings.base,
            "formats": list(self.ladder),
            "bits_budget": budget,
            "search_tokens": self.replay.num_tokens,
            "search_steps": steps,
            "groups": [self._group_row(g, final[g.name]) for g in self.groups],
            "sensitivity": {
                "measured": self.measured,
                "fisher": self.fisher,
                "rank_correlation": rank_correlation(self.measured, self.fisher),
                **({"fisher_note": self.fisher_note} if self.fisher_note else {}),
            },
            "additive": self._summary(start, trace[0]["mean_kld"]),
            "final": self._summary(final, min(row["best_kld"] for row in trace)),
            "search": trace,
            "pinned": pinned_patterns(self.groups, final, self.settings.base),
            "seconds": {k: round(v, 2) for k, v in seconds.items()},
        }
        return final, record

    def _summary(self, assignment: dict[str, str], measured: float) -> dict[str, Any]:
        return {
            "upgraded": {g: f for g, f in assignment.items() if f != self.settings.base},
            "predicted_kld": predicted_kl(self.measured, assignment),
            "measured_kld": measured,
            "effective_bits": round(effective_bits(self.groups, assignment), 4),
        }

    def _group_row(self, group: Group, fmt: str) -> dict[str, Any]:
        return {
            "name": group.name,
            "kind": group.kind,
            "layer": group.layer,
            "modules": list(group.modules),
            "weights": group.weights,
            "bits": {f: round(group.bits(f) / group.weights, 4) for f in self.ladder},
            "format": fmt,
        }
