"""The llmcompressor modifier of a quantize run and its oneshot application (the YAML schema is onboard.recipes)."""

import copy

import torch
from datasets import Dataset

from onboard.quantize.schemes import SCHEMES
from onboard.recipes import Quantize


def modifier(settings: Quantize, scheme: str, pinned: dict[str, list[str]] | None = None):
    """QuantizationModifier (RTN) or GPTQModifier: `scheme` on `settings.targets`, and pinned
    module patterns in their own formats. compressed-tensors resolves a module matched by both a
    class target ("Linear") and a name pattern in favour of the pattern, so pins win; pinned
    BF16 modules join `ignore`."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    cls = GPTQModifier if settings.algorithm == "gptq" else QuantizationModifier
    pinned = {fmt: list(patterns) for fmt, patterns in (pinned or {}).items() if patterns}
    ignore = list(settings.ignore) + pinned.pop("bf16", [])
    groups = [(scheme, list(settings.targets)), *sorted(pinned.items())]
    if all(SCHEMES[fmt].preset for fmt, _ in groups):
        # llmcompressor's preset names, as its own examples write mixed recipes; they also keep
        # the saved recipe.yaml plain data (explicit config groups under GPTQ serialise an enum
        # with a Python tag that yaml.safe_load refuses).
        presets: dict[str, list[str]] = {}
        for fmt, targets in groups:
            presets.setdefault(SCHEMES[fmt].preset, []).extend(targets)
        return cls(scheme=presets, ignore=ignore)
    config_groups = {f"group_{i}": SCHEMES[fmt].quantization_scheme(targets) for i, (fmt, targets) in enumerate(groups)}
    return cls(config_groups=config_groups, ignore=ignore)


def needs_calibration(settings: Quantize, formats: set[str]) -> bool:
    return settings.algorithm == "gptq" or any(SCHEMES[f].calibrated for f in formats)


def apply(model: torch.nn.Module, tokenizer, recipe, dataset: Dataset | None, max_seq_length: int) -> None:
    """llmcompressor oneshot, in place, on calibration `dataset` (None: data-free formats)."""
    from llmcompressor import oneshot

    from onboard.models.moe_artifact import quantize_expert_inputs_per_token

    if dataset is None:
        oneshot(model=model, tokenizer=tokenizer, recipe=recipe)
        quantize_expert_inputs_per_token(model)
        return
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=max_seq_length,
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
    )
    quantize_expert_inputs_per_token(model)


def quantized_copy(model, tokenizer, settings: Quantize, fmt: str, dataset: Dataset | None) -> torch.nn.Module:
    """A copy of `model` with every target in `fmt`, weights quantized once and for all.

    compressed-tensors re-quantizes weights in every forward; a candidate search runs hundreds
    of forwards over unchanged weights, so the quantize-dequantize result is stored in the
    weight and the module marked compressed (its forward then quantizes activations alone).
    The logits are identical; only the search's copies are treated so, never an artifact.
    """
    quantized = copy.deepcopy(model)
    _quantize_once(quantized, tokenizer, settings, fmt, dataset)
    return quantized.eval()


def offloaded_copy(checkpoint, offload, tokenizer, settings: Quantize, fmt: str, dataset: Dataset | None):
    """`quantized_copy` of a checkpoint larger than memory: loaded offloaded (`load_offloaded`),
    calibrated one layer at a time, its quantized weights written to `offload` (a bf16 copy of
    every target on disk), never more than one module's weights in memory."""
    from onboard.quantize.offloaded import load_offloaded

    quantized = load_offloaded(checkpoint, offload)
    _quantize_once(quantized, tokenizer, settings, fmt, dataset)
    return quantized.eval()


def _quantize_once(model, tokenizer, settings: Quantize, fmt: str, dataset: Dataset | None) -> None:
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    calibrated = dataset if needs_calibration(settings, {fmt}) else None
    apply(model, tokenizer, modifier(settings, fmt), calibrated, settings.calibration.max_seq_length)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None and scheme.weights is not None:
                # in place, or into the offload folder where the module is offloaded
                quantized = forward_quantize(module, module.weight.data, "weight", scheme.weights)
                update_offload_parameter(module, "weight", quantized)
                module.quantization_status = QuantizationStatus.COMPRESSED
