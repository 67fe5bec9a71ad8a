"""KL distillation of NVFP4 block scales (`quantize --distill-tokens N`).

After llm-compressor has quantized the model, what the format leaves free is each 16-weight
block's FP8 scale. Those scales are trained on the KL divergence from the unquantized model's
next-token distributions over N calibration tokens: the FP4 rounding and the scales' FP8 rounding
pass the gradient straight through, the scale's gradient as in LSQ (Esser et al., 2020), and each
scale is trained in log space so one learning rate suits every magnitude. The trained scales are
rounded to FP8 E4M3 and written into `weight_scale`, so compressed-tensors saves a plain NVFP4
checkpoint; they are kept only if the calibration KL did not rise.

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
LEARNING_RATE = 1e-2  # Adam, on the log of each scale: an FP8 E4M3 step is 6-12 % of a scale


def distill_scales(student: torch.nn.Module, teacher: torch.nn.Module, windows: list[torch.Tensor]) -> dict[str, Any]:
    """Train the NVFP4 weight scales of `student` (quantized by llm-compressor, in place) on KL to
    `teacher` over `windows` (token ids, one sequence each); the record of what it did."""
    clock = time.perf_counter()
    scaled = _nvfp4_modules(student)
    if not scaled:
        return {"tokens": 0, "kept": False, "reason": "no NVFP4 weights"}
    device = next(student.parameters()).device
    before = calibration_kl(student, teacher, windows)
    originals = {name: module.weight_scale.data.clone() for name, module in scaled.items()}
    logs = {
        name: torch.zeros_like(module.weight_scale, dtype=torch.float32, requires_grad=True)
        for name, module in scaled.items()
    }
    optimizer = torch.optim.Adam(logs.values(), lr=LEARNING_RATE)
    steps = EPOCHS * len(windows)
    losses = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeRemainingColumn(),
    )
    with _trainable_forwards(scaled, originals, logs), Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("distilling NVFP4 scales", total=steps, loss=before)
        for step in range(steps):
            ids = windows[step % len(windows)][None].to(device)
            with torch.no_grad():
                target = F.log_softmax(teacher(ids).logits.float(), -1)
            loss = _kl(target, F.log_softmax(student(ids).logits.float(), -1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            bar.update(task, advance=1, loss=losses[-1])
    with torch.no_grad():
        for name, module in scaled.items():
            module.weight_scale.data = _trained(originals[name], logs[name]).to(module.weight_scale.dtype)
    after = calibration_kl(student, teacher, windows)
    kept = after <= before
    if not kept:
        for name, module in scaled.items():
            module.weight_scale.data = originals[name]
    changed = sum(int((module.weight_scale.data != originals[name]).sum()) for name, module in scaled.items())
    return {
        "tokens": sum(len(w) for w in windows),
        "steps": steps,
        "modules": len(scaled),
        "calibration_kld_before": before,
        "calibration_kld_after": after,
        "kept": kept,
        "scales_changed": changed if kept else 0,
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
            target = F.log_softmax(teacher(ids).logits.float(), -1)
            kl = _kl(target, F.log_softmax(student(ids).logits.float(), -1))
            total, count = total + float(kl.sum()), count + kl.numel()
    return total / count


def distill_windows(input_ids: list[list[int]], tokens: int) -> list[torch.Tensor]:
    """The first `tokens` calibration tokens, as the calibration sequences they came in."""
    windows, taken = [], 0
    for ids in input_ids:
        if taken >= tokens:
            break
        window = torch.tensor(ids[: tokens - taken])
        if len(window) > 1:
            windows.append(window)
            taken += len(window)
    return windows


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


def _trained(original: torch.Tensor, log: torch.Tensor) -> torch.Tensor:
    """original · e^log rounded to FP8 E4M3, the rounding passed straight through."""
    scale = original.float() * log.exp()
    rounded = scale.clamp(max=torch.finfo(torch.float8_e4m3fn).max).to(torch.float8_e4m3fn).float()
    return scale + (rounded - scale).detach()


@contextmanager
def _trainable_forwards(modules: dict[str, torch.nn.Module], originals: dict, logs: dict):
    """Each module's forward as compressed-tensors computes it (activations quantized, weights in
    NVFP4 with its scales), rounding passed straight through so gradients reach the scales."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, forward_quantize

    saved = {name: module.forward for name, module in modules.items()}

    def forward_of(module: torch.nn.Module, name: str):
        args = module.quantization_scheme.weights
        acts = module.quantization_scheme.input_activations
        out_features, in_features = module.weight.shape
        weight = module.weight.detach().float().view(out_features, in_features // 16, 16)
        global_scale = module.weight_global_scale.float()

        def forward(x: torch.Tensor) -> torch.Tensor:
            if acts is not None:
                x = x + (forward_quantize(module, x, "input", acts) - x).detach()
            scale = _trained(originals[name], logs[name])  # [out, in / 16]
            step = (scale / global_scale)[..., None]
            with torch.no_grad():
                values = fake_quantize(
                    module.weight.float(), scale.detach(), None, args, global_scale=global_scale
                ).view_as(weight)
                rounded = values / step
            ratio = (weight / step).clamp(-6, 6)
            # value: compressed-tensors' own NVFP4 weight; d/dstep: rounded - ratio inside the range (LSQ)
            quantized = step * (rounded + ratio - ratio.detach())
            return F.linear(x, quantized.view(out_features, in_features).to(x.dtype), module.bias)

        return forward

    for name, module in modules.items():
        module.forward = forward_of(module, name)
    try:
        yield
    finally:
        for name, module in modules.items():
            module.forward = saved[name]
