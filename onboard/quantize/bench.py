"""`onboard bench-quant`: every quantization method at 4.5 bits, each lever on the weights and on the
activations alone, RTN and the best method with distilled scales (`--distill-tokens`), then the
best method's fixed rules and additive and searched selections, all scored on the same held-out
text (never the calibration text they were fitted on). Rows are saved as they are measured and
a rerun on the same file measures only those it lacks."""

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard import atomic
from onboard.console import console
from onboard.evaluate.stage import eval_windows, measure_kl
from onboard.models import Checkpoint, load_model, load_tokenizer
from onboard.quantize.auto import Selection
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.distill import distill_scales, distill_windows
from onboard.quantize.groups import ATTENTION_KINDS, Group, decision_groups, effective_bits
from onboard.quantize.method_choice import method_of
from onboard.quantize.modifiers import apply, modifier, prepared_copy, quantized_copy
from onboard.recipes import Method, Recipe
from onboard.workspace import package_versions

# Every accuracy method llm-compressor ships that keeps the artifact plain NVFP4, and the
# combinations its own results suggest (an observer under GPTQ or after rotations).
METHODS = (
    "rtn",
    "mse",
    "expanded_mse",
    "imatrix",
    "expanded_imatrix",
    "gptq",
    "gptq+expanded_mse",
    "gptq+expanded_imatrix",
    "spinquant",
    "spinquant+expanded_mse",
    "spinquant+gptq+expanded_mse",
    "smoothquant",
    "smoothquant+expanded_mse",
    "awq",
    "awq+expanded_mse",
    "autoround",
)
SELECTIONS = ("uniform", "heuristic_attn_fp8", "heuristic_down_fp8", "heuristic_ends_bf16", "additive", "search")


def heuristics(groups: list[Group], base: str) -> dict[str, dict[str, str]]:
    """The one-line rules people use: attention in FP8, down_proj in FP8, first and last two
    decoder layers in BF16; everything else in the base format."""
    last = max(g.layer for g in groups if g.layer is not None)

    def rule(pick) -> dict[str, str]:
        return {g.name: pick(g) or base for g in groups}

    return {
        "heuristic_attn_fp8": rule(lambda g: "fp8" if g.kind in ATTENTION_KINDS else None),
        "heuristic_down_fp8": rule(lambda g: "fp8" if g.kind == "down_proj" else None),
        "heuristic_ends_bf16": rule(lambda g: "bf16" if g.layer in (0, 1, last - 1, last) else None),
    }


def run_bench_quant(
    checkpoint: Checkpoint,
    recipe: Recipe,
    budgets: list[float],
    calib: Path | None,
    data: Path | None,
    out: Path,
    methods: tuple[str, ...] = METHODS,
) -> dict[str, Any]:
    """Every method uniform at 4.5 bits (NVFP4 W4A4), each lever also on one half of the damage
    (weights only: NVFP4A16; activations only, for the levers that move activations), RTN and the
    best method distilled when the recipe sets `distill_tokens`, then the best method through the
    fixed rules and the searched selection at each budget."""
    settings = recipe.quantize.model_copy(
        update={"scheme": "nvfp4", "bits_budget": None, "base": "nvfp4", "formats": {}, "method": Method()}
    )
    torch.manual_seed(0)
    tokenizer = load_tokenizer(checkpoint)
    reference = load_model(checkpoint)
    dataset = calibration_dataset(tokenizer, settings.calibration, calib)
    windows = eval_windows(tokenizer, recipe.eval, data)
    result: dict[str, Any] = {
        "model": str(checkpoint.path),
        "data": str(data) if data else "builtin:eval",
        "calibration": str(calib) if calib else "builtin:calib",
        "settings": settings.model_dump(mode="json", exclude={"method", "candidates", "distill_tokens"}),
        "eval": recipe.eval.model_dump(mode="json"),
        "heldout_tokens": sum(len(w) - 1 for _, w in windows),
        "versions": package_versions(),  # another onboard or llm-compressor: every row again
    }
    # A run takes hours with every method: each row is saved as it is measured, and a rerun with the
    # same model, data and settings measures only the rows `out` lacks (more methods, budgets).
    earlier = _earlier_run(out, result)
    measured = {_key(row): row for row in earlier.get("rows", [])}
    rows: list[dict[str, Any]] = []

    def kept() -> list[dict[str, Any]]:
        """This run's rows, then those measured before that it has not reached (or does not run)."""
        done = {_key(row) for row in rows}
        return rows + [row for key, row in measured.items() if key not in done]

    def save() -> None:
        atomic.write_json(out, {**result, **_facts(earlier), "rows": kept()})

    def resumed(key: tuple) -> bool:
        row = _find(measured, key)
        if row is not None:
            rows.append(row)
            save()
        return row is not None

    def score(selection: str, method: str, fmt: str, candidate, budget: float, bits: float, seconds: float, **extra):
        console.print(f"[bold]{selection} {method} {fmt}[/] at {bits:.3f} bits: scoring on held-out text")
        stats = measure_kl(reference, candidate, windows)["all"].summary()
        row = {
            "selection": selection,
            "method": method,
            "format": fmt,
            "budget": budget,
            "effective_bits": round(bits, 4),
            "mean_kld": stats["mean_kld"],
            "top1_agreement": stats["top1_agreement"],
            "seconds": round(seconds, 1),
            **extra,
        }
        rows.append(row)
        save()
        console.print(f"  mean KLD {row['mean_kld']:.4f}, same top token {100 * row['top1_agreement']:.1f} %")

    def uniform(method: Method, fmt: str) -> None:
        if resumed(("uniform", method.name, fmt, None)):
            return
        clock = time.perf_counter()
        with_method = settings.model_copy(update={"method": method})
        if fmt == "nvfp4_activations":
            # The lever as found for NVFP4 (AWQ's scales are searched against the weights' error,
            # which this format has none of), then the activations alone quantized.
            prepared, rest = prepared_copy(reference, tokenizer, with_method, dataset)
            candidate = quantized_copy(prepared, tokenizer, rest, fmt, dataset)
        else:
            candidate = quantized_copy(reference, tokenizer, with_method, fmt, dataset)
        seconds = time.perf_counter() - clock
        groups = decision_groups(candidate)
        bits = effective_bits(groups, {g.name: fmt for g in groups})
        score("uniform", method.name, fmt, candidate, round(bits, 4), bits, seconds)

    def distilled(tokens: int, names) -> None:
        """Uniform NVFP4 with the method, then its block scales distilled on `tokens` calibration tokens."""
        windows, held_back = distill_windows(dataset["input_ids"], tokens)
        for name in names:
            row = _find(measured, ("distilled", name, "nvfp4", None))
            data = (sum(len(w) for w in windows), sum(len(w) for w in held_back))  # what a row was distilled on
            if row is not None and (row["distill"]["tokens"], row["distill"].get("held_back_tokens")) == data:
                resumed(("distilled", name, "nvfp4", None))
                continue
            clock = time.perf_counter()
            candidate = copy.deepcopy(reference)
            recipe_of = modifier(settings.model_copy(update={"method": method_of(name)}), "nvfp4")
            apply(candidate, tokenizer, recipe_of, dataset, settings.calibration.max_seq_length)
            record = distill_scales(candidate, reference, windows, held_back)
            seconds = time.perf_counter() - clock
            groups = decision_groups(candidate)
            bits = effective_bits(groups, {g.name: "nvfp4" for g in groups})
            score("distilled", name, "nvfp4", candidate.eval(), round(bits, 4), bits, seconds, distill=record)

    for name in methods:
        uniform(method_of(name), "nvfp4")
    # over every uniform NVFP4 row the file holds: a rerun of fewer methods keeps the best
    best_row = min(
        (r for r in kept() if r["selection"] == "uniform" and r["format"] == "nvfp4"), key=lambda r: r["mean_kld"]
    )
    best = method_of(best_row["method"])
    console.print(f"best uniform method: {best.name} (mean KLD {best_row['mean_kld']:.4f})")
    # One lever at a time (and the best), on each half: the weights alone, and the activations
    # alone where the lever moves them (smoothing and rotations; the rest change only weights).
    for name in dict.fromkeys([*(name for name in methods if "+" not in name), best.name]):
        method = method_of(name)
        if method.algorithm != "autoround":  # auto-round has no NVFP4A16 preset: it would round to nearest
            uniform(method, "nvfp4a16")
        if method.algorithm == "rtn" and method.observer == "minmax":
            uniform(method, "nvfp4_activations")

    if recipe.quantize.distill_tokens:
        distilled(recipe.quantize.distill_tokens, dict.fromkeys(["rtn", best.name]))

    settings = settings.model_copy(update={"method": best})
    keys = [(rule, best.name, "mixed", None) for rule in SELECTIONS[1:4]]
    keys += [(kind, best.name, "mixed", budget) for budget in budgets for kind in ("additive", "search")]
    if all(_find(measured, key) for key in keys):
        rows.extend(_find(measured, key) for key in keys)
        return _finish(out, {**result, "rows": kept(), "best_method": best.name, **_facts(earlier)})
    # its own copy: the composer swaps groups into the model it is given, and `score` compares with
    # `reference` (a method without smoothing or rotations composes on the model itself)
    selection = Selection(copy.deepcopy(reference), tokenizer, settings, dataset, budgets)
    groups, composer, model = selection.groups, selection.composer, selection.model
    for rule, assignment in heuristics(groups, settings.base).items():
        if resumed((rule, best.name, "mixed", None)):
            continue
        bits = effective_bits(groups, assignment)
        composer.apply(assignment)
        score(rule, best.name, "mixed", model, round(bits, 4), bits, selection.seconds["sources"])

    record: dict[str, Any] = {}
    for budget in budgets:
        if all(_find(measured, (kind, best.name, "mixed", budget)) for kind in ("additive", "search")):
            for kind in ("additive", "search"):
                resumed((kind, best.name, "mixed", budget))
            continue
        final, record = selection.select(budget, settings.search.steps)
        additive = {**selection.uniform(), **record["additive"]["upgraded"]}
        ready = record["seconds"]
        before_search = ready["sources"] + ready["sensitivity"] + ready.get("fisher", 0)
        for kind, assignment, seconds, part in (
            ("additive", additive, before_search, record["additive"]),
            ("search", final, before_search + ready["search"], record["final"]),
        ):
            composer.apply(assignment)
            upgraded = {g: f for g, f in assignment.items() if f != settings.base}
            score(
                kind,
                best.name,
                "mixed",
                model,
                budget,
                effective_bits(groups, assignment),
                seconds,
                calibration_kld=part["measured_kld"],
                upgraded=upgraded,
            )
    composer.reset()
    result.update(
        search_tokens=selection.replay.num_tokens,
        search_steps=settings.search.steps,
        best_method=best.name,
        rank_correlation=record["sensitivity"]["rank_correlation"] if record else earlier.get("rank_correlation"),
    )
    return _finish(out, {**result, "rows": kept()})


def _key(row: dict[str, Any]) -> tuple:
    return row["selection"], row["method"], row["format"], row["budget"]


def _earlier_run(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """An earlier run into `out` with the same model, texts and settings ({} if none)."""
    if not out.is_file():
        return {}
    earlier = json.loads(out.read_text())
    if any(earlier.get(key) != value for key, value in result.items()):
        console.print(f"{out} was measured with other settings: measuring every row again")
        return {}
    console.print(f"{out}: the {len(earlier.get('rows', []))} rows measured before are kept")
    return earlier


def _facts(earlier: dict[str, Any]) -> dict[str, Any]:
    return {k: earlier[k] for k in ("search_tokens", "search_steps", "rank_correlation") if k in earlier}


def _find(measured: dict[tuple, dict[str, Any]], key: tuple) -> dict[str, Any] | None:
    """A row by key; None for the budget of a row whose budget is its own effective bits."""
    if key[3] is not None:
        return measured.get(key)
    return next((r for k, r in measured.items() if k[:3] == key[:3]), None)


def _finish(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    atomic.write_json(out, result)
    console.print(bench_table(result["rows"]))
    return result


def bench_table(rows: list[dict[str, Any]]) -> Table:
    uniform = next((r["mean_kld"] for r in rows if r["method"] == "rtn" and r["format"] == "nvfp4"), None)
    table = Table(title="held-out KL by method and selection", title_justify="left")
    for column in ("selection", "method", "format", "budget", "bits", "KLD", "× preset", "top-1", "s"):
        table.add_column(
            column, justify="left" if column in ("selection", "method", "format") else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(
            row["selection"],
            row["method"],
            row["format"],
            f"{row['budget']:.2f}",
            f"{row['effective_bits']:.3f}",
            f"{row['mean_kld']:.4f}",
            f"{row['mean_kld'] / uniform:.2f}" if uniform else "-",
            f"{100 * row['top1_agreement']:.1f} %",
            f"{row['seconds']:.0f}",
        )
    return table
