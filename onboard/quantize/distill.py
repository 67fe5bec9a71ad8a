"""KL distillation of NVFP4 block scales (`quantize --distill-tokens N`).

After llm-compressor has quantized the model, what the format leaves free is each 16-weight
block's FP8 scale. Those scales are trained on the KL divergence from the unquantized model's
next-token distributions over N calibration tokens: the FP4 rounding and the scales' FP8 rounding
pass the gradient straight through, the scale's gradient as in LSQ (Esser et al., 2020), and each
scale is trained in log space so one learning rate suits every magnitude. The trained scales are
rounded to FP8 E4M3 and written into `weight_scale`, so compressed-tensors saves a plain NVFP4
checkpoint.  The last eighth of the calibration sequences is held back from training: the scales
of the epoch with the lowest KL there are kept, and none if no epoch lowered it (on SmolLM2 the
training tokens' KL kept falling while held-out KL did not move: fitting, which only text the
training never saw shows).

Written here because neither llm-compressor nor compressed-tensors trains scales on an end-to-end
loss (AutoRound tunes one decoder block at a time on that block's output error).
"""

import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from onboard.console import console

EPOCHS = 4  # passes over the distillation tokens
HELD_BACK = 1 / 8  # of the calibration sequences (at least one), never trained on, judging each epoch
LEARNING_RATE = 1e-2  # Adam, on the log of each scale: an FP8 E4M3 step is 6-12 % of a scale


def distill_scales(
    student: torch.nn.Module, teacher: torch.nn.Module, windows: list[torch.Tensor], held_back: list[torch.Tensor]
) -> dict[str, Any]:
    """Train the NVFP4 weight scales of `student` (quantized by llm-compressor, in place) on KL to
    `teacher` over `windows` (token ids, one sequence each), keeping the epoch's scales with the
    lowest KL on `held_back` (the training windows themselves when there are none); the record of
    what it did."""
    clock = time.perf_counter()
    scaled = _nvfp4_modules(student)
    if not scaled or not windows:
        raise ValueError("distillation needs NVFP4 weights and at least one calibration window")
    judged_on = held_back or windows
    device = next(student.parameters()).device
    before, judged_before = calibration_kl(student, teacher, windows), calibration_kl(student, teacher, judged_on)
    originals = {name: module.weight_scale.data.clone() for name, module in scaled.items()}
    log_scales = {
        name: torch.zeros(module.weight_scale.shape, device=module.weight_scale.device, requires_grad=True)
        for name, module in scaled.items()
    }
    optimizer = torch.optim.Adam(log_scales.values(), lr=LEARNING_RATE)
    steps = EPOCHS * len(windows)
    losses, judged = [], []
    best, best_epoch = {}, 0
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("KL {task.fields[kl]:.4f}"))
    with (
        _frozen(student),
        _trainable_forwards(student, scaled, originals, log_scales),
        Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar,
    ):
        task = bar.add_task("distilling NVFP4 scales", total=steps, kl=before)
        for step in range(steps):
            ids = windows[step % len(windows)][None].to(device)
            target = _teacher_log_probs(teacher, ids)
            loss = _kl(target, F.log_softmax(student(ids).logits.float(), -1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.update(task, advance=1, kl=losses[-1])
            if (step + 1) % len(windows) == 0:  # an epoch's end: judged on the held-back text
                judged.append(calibration_kl(student, teacher, judged_on))
                if judged[-1] < min([judged_before, *judged[:-1]]):
                    best = {name: _fp8_scale(originals[name], log_scales[name].detach()) for name in scaled}
                    best_epoch = len(judged)
    with torch.no_grad():
        for name, module in scaled.items():
            module.weight_scale.data = best.get(name, originals[name].float()).to(module.weight_scale.dtype)
    after, judged_after = calibration_kl(student, teacher, windows), calibration_kl(student, teacher, judged_on)
    kept = bool(best) and judged_after <= judged_before
    if not kept:
        for name, module in scaled.items():
            module.weight_scale.data = originals[name]
        after, judged_after = before, judged_before
    changed = sum(int((module.weight_scale.data != originals[name]).sum()) for name, module in scaled.items())
    return {
        "tokens": sum(len(w) for w in windows),
        "steps": steps,
        "modules": len(scaled),
        "calibration_kld_before": before,
        "calibration_kld_after": after,
        "held_back_tokens": sum(len(w) for w in held_back),
        "held_back_kld_before": judged_before,
        "held_back_kld_after": judged_after,
        "held_back_kld_by_epoch": judged,
        "best_epoch": best_epoch,
        "kept": kept,
        "scales_changed": changed,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": round(time.perf_counter() - clock, 1),
    }


def calibration_kl(student: torch.nn.Module, teacher: torch.nn.Module, windows: list[torch.Tensor]) -> float:
    """Mean per-token KL(teacher || student) over `windows`, through compressed-tensors' own forward."""
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            ids = window[None].to(next(student.parameters()).device)
            target = _teacher_log_probs(teacher, ids)
            kl = _kl(target, F.log_softmax(student(ids).logits.float(), -1))
            total, count = total + float(kl.sum()), count + kl.numel()
    return total / count


@torch.no_grad()
def _teacher_log_probs(teacher: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's float32 log-probabilities on `ids`, where the student is (the teacher may be
    on another device: the BF16 copy stays where it was loaded while the student is calibrated)."""
    logits = teacher(ids.to(next(teacher.parameters()).device)).logits.float()
    return F.log_softmax(logits, -1).to(ids.device)


def distill_windows(input_ids: list[list[int]], tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(training, held back): the last `HELD_BACK` of the calibration sequences (at least one, none
    from a single sequence) held back whole, and the first `tokens` tokens of the others to train
    on, as the sequences they came in."""
    held = max(1, round(len(input_ids) * HELD_BACK)) if len(input_ids) > 1 else 0
    train, held_back = input_ids[: len(input_ids) - held], input_ids[len(input_ids) - held :]
    windows, taken = [], 0
    for ids in train:
        if taken >= tokens:
            break
        window = torch.tensor(ids[: tokens - taken])
        if len(window) > 1:
            windows.append(window)
            taken += len(window)
    return windows, [torch.tensor(ids) for ids in held_back if len(ids) > 1]


def _kl(target: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    return (target.exp() * (target - log_probs)).sum(-1).flatten()


def _nvfp4_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Linears whose weights llm-compressor put in NVFP4 (FP4 values, 16-weight blocks, FP8 scales)."""
    found = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        weights = None if scheme is None else scheme.weights
        if weights is not None and weights.num_bits == 4 and weights.type == "float" and weights.group_size == 16:
            found[name] = module
    return found


# FP8 E4M3's range; compressed-tensors never stores a zero scale, so neither does training
SCALE_MIN, SCALE_MAX = 2.0**-9, torch.finfo(torch.float8_e4m3fn).max


def _fp8_scale(original: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """original · e^log_scale, as the FP8 E4M3 scale it will be stored as."""
    scale = (original.float() * log_scale.exp()).clamp(SCALE_MIN, SCALE_MAX)
    return scale.to(torch.float8_e4m3fn).float()


def _trainable_scale(original: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """`_fp8_scale`, its rounding passed straight through to the log-scale."""
    scale = (original.float() * log_scale.exp()).clamp(SCALE_MIN, SCALE_MAX)
    return scale + (_fp8_scale(original, log_scale) - scale).detach()


@contextmanager
def _frozen(model: torch.nn.Module):
    """No gradient for the model's own parameters (only the log-scales train), restored after."""
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    try:
        yield
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(flags[name])


@contextmanager
def _trainable_forwards(model: torch.nn.Module, scaled: dict[str, torch.nn.Module], originals: dict, log_scales: dict):
    """Every quantized module's forward as compressed-tensors computes it (activations quantized,
    weights in their format), each rounding passed straight through: gradients reach the NVFP4
    scales and, through modules of other formats (an FP8 group pinned beside NVFP4), the inputs."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, forward_quantize

    quantized = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    saved = {name: module.forward for name, module in quantized.items()}

    def activations(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        acts = module.quantization_scheme.input_activations
        return x if acts is None else x + (forward_quantize(module, x, "input", acts) - x).detach()

    def fixed(module: torch.nn.Module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, args = module.weight, module.quantization_scheme.weights
            if args is not None and module.quantization_status < QuantizationStatus.COMPRESSED:
                with torch.no_grad():
                    weight = forward_quantize(module, weight, "weight", args)
            return F.linear(activations(module, x), weight, module.bias)

        return forward

    def trainable(module: torch.nn.Module, name: str):
        args = module.quantization_scheme.weights
        out_features, in_features = module.weight.shape
        weight = module.weight.detach().float()
        blocks = weight.view(out_features, in_features // 16, 16)
        global_scale = module.weight_global_scale.float()

        def forward(x: torch.Tensor) -> torch.Tensor:
            scale = _trainable_scale(originals[name], log_scales[name])  # [out, in / 16]
            step = (scale / global_scale)[..., None]
            with torch.no_grad():
                rounded = fake_quantize(weight, scale.detach(), None, args, global_scale=global_scale).view_as(blocks)
                rounded = rounded / step
            ratio = (blocks / step).clamp(-6, 6)
            # value: compressed-tensors' own NVFP4 weight; d/dstep: rounded - ratio inside the range (LSQ)
            values = step * (rounded + ratio - ratio.detach())
            return F.linear(activations(module, x), values.view_as(weight).to(x.dtype), module.bias)

        return forward

    for name, module in quantized.items():
        module.forward = trainable(module, name) if name in scaled else fixed(module)
    try:
        yield
    finally:
        for name, module in quantized.items():
            module.forward = saved[name]
