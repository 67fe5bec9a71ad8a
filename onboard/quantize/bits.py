"""Effective bits per weight, read from the tensors a compressed-tensors checkpoint stores.

Counting what is on disk (packed values, block scales, global scales) rather than quoting a
format's nominal width keeps the number honest for every format and every mixture of them.
"""

from collections import defaultdict
from pathlib import Path

from onboard.models.headers import safetensors_entries
from onboard.quantize.patterns import matches
from onboard.recipes import NEVER_QUANTIZE

_BITS = {"U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "BF16": 16, "F16": 16, "F32": 32, "I32": 32, "I64": 64}
_WEIGHT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point")


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _format(parts: dict[str, tuple[str, list[int]]]) -> str:
    if "weight_packed" in parts:
        return "nvfp4" if "input_global_scale" in parts else "nvfp4a16"
    dtype = parts["weight"][0]
    if dtype.startswith("F8"):
        return "fp8"
    return dtype.lower()


def layer_bits(checkpoint: Path) -> dict[str, dict]:
    """Per weight-bearing module (2-D or fused 3-D weights): format, bits per weight, weights."""
    modules: dict[str, dict[str, tuple[str, list[int]]]] = defaultdict(dict)
    for name, entry in safetensors_entries(checkpoint).items():
        module, _, part = name.rpartition(".")
        modules[module][part] = (entry.dtype, list(entry.shape))
    layers = {}
    for module, parts in sorted(modules.items()):
        if "weight_packed" in parts:
            weights = 2 * _numel(parts["weight_packed"][1])  # two FP4 values per byte
        elif "weight" in parts and len(parts["weight"][1]) >= 2:
            weights = _numel(parts["weight"][1])
        else:
            continue  # norms and biases
        stored = sum(_BITS[parts[p][0]] * _numel(parts[p][1]) for p in _WEIGHT_PARTS if p in parts)
        layers[module] = {"format": _format(parts), "bits": round(stored / weights, 4), "weights": weights}
    return layers


# The DSA indexer (DeepSeek-V3.2, GLM-5) joins the routers: its top-k selection is discrete, and
# vLLM builds its fused wk/weights_proj without a quantization method (BF16 whatever the checkpoint).
_NOT_QUANTIZABLE = [*NEVER_QUANTIZE, "re:.*\\.indexer\\..*"]


def is_quantizable(module: str) -> bool:
    """Weights a recipe may put in low precision: every matrix but embeddings, heads, routers and
    the DSA indexer."""
    return "embed" not in module and not matches(module, _NOT_QUANTIZABLE)


def effective_bits(layers: dict[str, dict], only_quantizable: bool = True) -> float:
    chosen = [v for k, v in layers.items() if is_quantizable(k) or not only_quantizable]
    total = sum(v["weights"] for v in chosen)
    return round(sum(v["bits"] * v["weights"] for v in chosen) / total, 4) if total else 0.0
