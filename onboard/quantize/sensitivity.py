"""How much each group alone costs: end-to-end KL measured, and a Fisher estimate beside it."""

import torch
from rich.progress import Progress
from scipy.stats import spearmanr

from onboard.console import console
from onboard.evaluate.replay import LayerReplay
from onboard.quantize.compose import Composer


def measured_sensitivity(replay: LayerReplay, composer: Composer, formats: list[str]) -> dict[str, dict[str, float]]:
    """{group: {format: mean KL}} with that group alone in that format, every other in BF16.

    Layers before the group compute what the reference computes, so each run starts from the
    reference's recorded input of the group's layer.
    """
    result: dict[str, dict[str, float]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("sensitivity", total=len(composer.groups) * len(formats))
        for group in composer.groups:
            start = group.layer or 0
            for fmt in formats:
                composer.apply({group.name: fmt})
                kl, _ = replay.mean_kl(start, replay.reference_inputs[start])
                result.setdefault(group.name, {})[fmt] = kl
                progress.advance(task)
    composer.reset()
    return result


def fisher_sensitivity(
    replay: LayerReplay, composer: Composer, formats: list[str]
) -> dict[str, dict[str, float | None]]:
    """{group: {format: ½ Σ F δ²}}: the second-order estimate of the KL a weight error δ causes,
    with F the diagonal empirical Fisher of the reference on the same tokens. It sees weight
    error only (not activation quantization) and needs one backward pass in all; None where the
    original and quantized modules differ in structure (fused MoE experts)."""
    model = composer.model
    composer.reset()
    weights = {
        name: composer.originals[name].weight
        for g in composer.groups
        for name in g.modules
        if name in composer.originals
    }
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    squares = {name: torch.zeros_like(w, dtype=torch.float32) for name, w in weights.items()}
    try:
        for w in weights.values():
            w.requires_grad_(True)
        for window in replay.input_ids:
            logits = model(input_ids=window[None]).logits[0, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum")
            grads = torch.autograd.grad(loss, list(weights.values()))
            for name, grad in zip(weights, grads, strict=True):
                squares[name] += grad.float().pow(2)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
    result: dict[str, dict[str, float | None]] = {}
    for group in composer.groups:
        for fmt in formats:
            errors = composer.weight_error(group, fmt)
            estimate = None
            if errors is not None:
                estimate = (
                    0.5 * sum(float((squares[n] * e.pow(2)).sum()) for n, e in errors.items()) / replay.num_tokens
                )
            result.setdefault(group.name, {})[fmt] = estimate
    return result


def rank_correlation(
    measured: dict[str, dict[str, float]], estimated: dict[str, dict[str, float | None]]
) -> dict[str, float | None]:
    """Spearman's rho between measured and estimated sensitivities, per format."""
    formats = sorted({f for per in measured.values() for f in per})
    rho: dict[str, float | None] = {}
    for fmt in formats:
        pairs = [(measured[g][fmt], estimated[g][fmt]) for g in measured if estimated.get(g, {}).get(fmt) is not None]
        if len(pairs) < 3:
            rho[fmt] = None
            continue
        value = spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic
        rho[fmt] = None if value != value else round(float(value), 4)  # nan: a constant column
    return rho
