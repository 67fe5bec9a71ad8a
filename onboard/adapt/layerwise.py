"""Layerwise parity: the engine's and transformers' decoder layers compared one at a time.

For a checkpoint larger than memory, whole-model parity cannot hold both models at once.  Here
only the embeddings, the head and ONE decoder layer of each side are resident at a time: the
reference stream starts at the embeddings of the parity prompts, and for each layer i both sides
run layer i (built from the checkpoint's tensors for that layer only, `onboard.models.layers` for
transformers' side, plain or compressed-tensors) on transformers' recorded input of layer i,
the outputs are compared, and transformers' output becomes layer i+1's input.  Finally both
sides' norm and lm_head run on transformers' last hidden states.

Each layer's error is judged against its own floor: how far transformers' own output moves when
its input is rounded the other way in the last bit on a random half of its elements, which is
what a kernel that rounds differently anywhere upstream does.  The floor holds the layer's
rounding in the compute dtype and, where the layer quantizes its activations (W4A4, FP8 W8A8),
the quantizer's steps such a change flips, so a pure kernel difference lands near 1x its floor
while a layer that computes something else lands far above and is named (`MAX_LAYER_RATIO`).
Exact numerics compute transformers' own products, so the error is usually zero.
"""

from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from onboard.console import console
from onboard.engine import LayerStepper, checkpoint_linears
from onboard.memory import layer_by_layer
from onboard.models.layers import CheckpointLayers, check_layerwise, layer_tensors
from onboard.recipes import Gate

# A layer passes while its RMS error stays within this many times its floor's RMS, and each of
# its linears, run on transformers' own input for it, within MAX_LINEAR_RATIO times the RMS of
# its output's rounding step: the recipe schema's defaults, where the measurements are noted.
MAX_LAYER_RATIO = Gate.model_fields["max_parity_layer_ratio"].default
MAX_LINEAR_RATIO = Gate.model_fields["max_parity_linear_ratio"].default


def last_bit_perturbed(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x with a random half of its elements one unit in the last place larger in magnitude (the
    integer view of a float grows with its magnitude, sign aside)."""
    int_type = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[x.dtype]
    bump = torch.randint(0, 2, x.shape, generator=gen, dtype=int_type).to(x.device)
    return (x.contiguous().view(int_type) + bump).view(x.dtype)


def ulp(y: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of `y`, in its dtype (its rounding step)."""
    magnitude = y.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude


class _Error:
    """A module's error against transformers' output and its floor, over every prompt."""

    def __init__(self, name: str):
        self.name = name
        self.max_abs = self.scale = 0.0
        self.error_sq = self.floor_sq = 0.0
        self.count = 0

    def add(self, mine: torch.Tensor, theirs: torch.Tensor, moved: torch.Tensor | None = None) -> None:
        """The floor: the output's own rounding step and, given `moved` (transformers' output on the
        perturbed input), how far that moved it.  A routed expert no token chose adds nothing."""
        if theirs.numel() == 0:
            return
        floor = ulp(theirs).double().square()
        if moved is not None:
            floor += (moved.double() - theirs.double()).square()
        mine, theirs = mine.float(), theirs.float()
        self.max_abs = max(self.max_abs, float((mine - theirs).abs().max()))
        self.scale = max(self.scale, float(theirs.abs().max()))
        self.error_sq += float((mine - theirs).double().square().sum())
        self.floor_sq += float(floor.sum())
        self.count += theirs.numel()

    @property
    def ratio(self) -> float:
        return 0.0 if self.error_sq == 0 else (self.error_sq / self.floor_sq) ** 0.5

    def entry(self) -> dict[str, Any]:
        return {
            "layer": self.name,
            "max_abs_diff": self.max_abs,
            "relative_diff": self.max_abs / max(1.0, self.scale),
            "error_rms": (self.error_sq / self.count) ** 0.5,
            "floor_rms": (self.floor_sq / self.count) ** 0.5,
            "floor_ratio": self.ratio,
            "passed": self.ratio <= MAX_LAYER_RATIO,
        }


class _LinearRecorder:
    """transformers' linears in one layer, recording (input, output) while `active`."""

    def __init__(self, layer: torch.nn.Module, prefix: str):
        self.active = False
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._hook(f"{prefix}.{name}"))

    def _hook(self, name: str):
        def record(_module, args, output):
            if self.active:
                self.calls.setdefault(name, []).append((args[0].detach(), output.detach()))

        return record


def _linear_errors(recorder: _LinearRecorder, engine_layer: torch.nn.Module, errors: dict[str, "_Error"]) -> None:
    """Each engine linear on transformers' own recorded input for it, against its output; the
    floor is the output's rounding step (the inputs are the same, so the quantizer's are too)."""
    mine = checkpoint_linears(engine_layer)
    for name, calls in recorder.calls.items():
        if name not in mine:  # fused on the engine's side, or a reference-only module
            continue
        error = errors.setdefault(name, _Error(name))
        for inputs, output in calls:
            flat = output.reshape(-1, output.shape[-1])
            error.add(mine[name](inputs.reshape(-1, inputs.shape[-1])), flat)
    recorder.calls.clear()


@torch.inference_mode()
def measure_layerwise(
    path: Path, prompts: list[list[int]], dtype: torch.dtype, device: str = "cpu", engine_layer=None
) -> dict[str, Any]:
    """Per decoder layer (and the head), the engine's output against transformers' on transformers'
    input, each error against the layer's floor.  `engine_layer(stepper, index)`: how the engine's
    layer is built from the `LayerStepper` (default `stepper.decoder_layer(index)`; a test breaks one)."""
    device_ = torch.device(device)
    config = check_layerwise(path)
    stepper = LayerStepper(path, dtype, device_)
    build = engine_layer or (lambda stepper, i: stepper.decoder_layer(i))
    reference = CheckpointLayers(path, config, dtype, device_)
    streams = [stepper.embed(p) for p in prompts]
    steps = [stepper.prefill(len(p)) for p in prompts]
    topk: list[torch.Tensor | None] = [None] * len(prompts)
    gen = torch.Generator().manual_seed(0)
    layers = []
    with Progress(console=console) as progress, layer_by_layer() as drop:
        task = progress.add_task("layerwise parity", total=config.num_hidden_layers)
        for index in range(config.num_hidden_layers):
            theirs_layer = reference.layer(index)
            mine_layer = build(stepper, index)
            error = _Error(f"model.layers.{index}")
            recorder, linears = _LinearRecorder(theirs_layer, f"model.layers.{index}"), {}
            for p, x in enumerate(streams):
                position_ids = torch.arange(x.shape[0], device=device_)[None]
                kwargs = reference.layer_kwargs(theirs_layer, x[None], position_ids)
                if getattr(config, "indexer_types", None) is not None:
                    kwargs["prev_topk_indices"] = topk[p]
                recorder.active = True
                want, selected = _run(theirs_layer, x, kwargs)
                recorder.active = False
                moved, _ = _run(theirs_layer, last_bit_perturbed(x, gen), kwargs)
                error.add(stepper.run_decoder_layer(mine_layer, x, steps[p]), want[0], moved[0])
                _linear_errors(recorder, mine_layer, linears)
                streams[p], topk[p] = want[0], selected
            entry = error.entry()
            worst = max(linears.values(), key=lambda e: e.ratio, default=None)
            entry["linear_ratio"] = 0.0 if worst is None else worst.ratio
            entry["worst_linear"] = None if worst is None else worst.name
            entry["passed"] = entry["passed"] and entry["linear_ratio"] <= MAX_LINEAR_RATIO
            layers.append(entry)
            del theirs_layer, mine_layer
            drop()
            progress.advance(task)
    head = _head(path, config, stepper, reference, streams, gen)
    failing = [e["layer"] for e in layers if not e["passed"]] + ([] if head["passed"] else ["head"])
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": len(prompts),
        "num_tokens": sum(len(p) for p in prompts),
        "max_layer_ratio": MAX_LAYER_RATIO,
        "layers": layers,
        "head": head,
        "max_abs_diff": max([e["max_abs_diff"] for e in layers] + [head["max_abs_diff"]]),
        "max_floor_ratio": max([e["floor_ratio"] for e in layers] + [head["floor_ratio"]]),
        "max_linear_ratio": max([e["linear_ratio"] for e in layers], default=0.0),
        "max_linear_ratio_allowed": MAX_LINEAR_RATIO,
        "passed": not failing,
        "first_failing_layer": failing[0] if failing else None,
        # the linear that failed in it, where one did (its own input, its output's rounding step)
        "first_failing_module": next(
            (e["worst_linear"] for e in layers if not e["passed"] and e["linear_ratio"] > MAX_LINEAR_RATIO), None
        ),
    }


def _run(layer: torch.nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """transformers' layer on `[T, H]` rows: (its output, the top-k GLM-5 layers hand on, or None)."""
    out = layer(x[None], **kwargs)
    return out if isinstance(out, tuple) else (out, None)


def _head(path, config, stepper: LayerStepper, reference: CheckpointLayers, streams, gen) -> dict[str, Any]:
    """The final norm and lm_head of both sides on transformers' last hidden states."""
    norm = reference.norm()
    if getattr(config, "tie_word_embeddings", False):
        head_weight = stepper.embed_tokens
    else:
        head_weight = layer_tensors(path, "lm_head.")["weight"].to(device=reference.device, dtype=reference.dtype)
    error = _Error("head")
    for x in streams:
        want = torch.nn.functional.linear(norm(x[None])[0], head_weight)
        moved = torch.nn.functional.linear(norm(last_bit_perturbed(x, gen)[None])[0], head_weight)
        error.add(stepper.compute_logits(stepper.final_norm(x)), want, moved)
    return error.entry()
