"""Decision groups: the modules that must share one format because a serving engine fuses them.

vLLM runs q/k/v as one QKVParallelLinear and gate/up as one MergedColumnParallelLinear (one
kernel, one format, shared global scales), and all experts of a MoE layer as one fused kernel;
a selection that split them could not be served.
"""

import re
from dataclasses import dataclass

import torch

from onboard.quantize.schemes import SCHEMES

LAYER = re.compile(r"\.layers\.(\d+)\.")
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")


@dataclass(frozen=True)
class Group:
    name: str  # e.g. model.layers.3.self_attn.qkv
    kind: str  # qkv | gate_up | experts | the module's own name (o_proj, down_proj, ...)
    layer: int | None
    units: tuple[str, ...]  # module paths swapped as one when candidates are composed
    modules: tuple[str, ...]  # the Linear modules it holds (names as llmcompressor quantizes them)
    shapes: tuple[tuple[int, int], ...]  # [out, in] of each module
    pattern: str  # a compressed-tensors target matching exactly these modules

    @property
    def weights(self) -> int:
        return sum(o * i for o, i in self.shapes)

    def bits(self, fmt: str) -> int:
        return sum(SCHEMES[fmt].stored_bits(o, i) for o, i in self.shapes)


def _key(name: str) -> tuple[str, str, str]:
    """(group name, kind, swap unit) of one quantized Linear module."""
    experts = _EXPERTS.match(name)
    if experts:
        return experts.group(1), "experts", experts.group(1)
    parent, _, leaf = name.rpartition(".")
    if leaf in _FUSED:
        return f"{parent}.{_FUSED[leaf]}", _FUSED[leaf], name
    return name, leaf, name


def _pattern(kind: str, name: str, modules: list[str]) -> str:
    if kind == "experts":
        return f"re:^{re.escape(name)}\\.\\d+\\..*"
    if len(modules) == 1:
        return f"re:^{re.escape(modules[0])}$"
    parent = re.escape(name.rpartition(".")[0])
    leaves = "|".join(re.escape(m.rpartition(".")[2]) for m in modules)
    return f"re:^{parent}\\.({leaves})$"


def decision_groups(quantized: torch.nn.Module) -> list[Group]:
    """The groups of a model llmcompressor has quantized (every module with a scheme), in
    module order. Reading the quantized model, not the original, names MoE experts the way
    llmcompressor unfuses them."""
    found: dict[str, dict] = {}
    for name, module in quantized.named_modules():
        if getattr(module, "quantization_scheme", None) is None or not isinstance(module, torch.nn.Linear):
            continue
        group, kind, unit = _key(name)
        entry = found.setdefault(group, {"kind": kind, "units": [], "modules": [], "shapes": []})
        if unit not in entry["units"]:
            entry["units"].append(unit)
        entry["modules"].append(name)
        entry["shapes"].append((module.out_features, module.in_features))
    groups = []
    for name, entry in found.items():
        layer = LAYER.search(name + ".")
        groups.append(
            Group(
                name=name,
                kind=entry["kind"],
                layer=int(layer.group(1)) if layer else None,
                units=tuple(entry["units"]),
                modules=tuple(entry["modules"]),
                shapes=tuple(entry["shapes"]),
                pattern=_pattern(entry["kind"], name, entry["modules"]),
            )
        )
    return groups


def effective_bits(groups: list[Group], assignment: dict[str, str]) -> float:
    """Exact bits per quantizable weight of an assignment {group name: format}."""
    return sum(g.bits(assignment[g.name]) for g in groups) / sum(g.weights for g in groups)


def fits(bits: float, budget: float) -> bool:
    """Budgets are met at the 0.001-bit resolution effective bits are quoted at, so the per-tensor
    FP32 global scales (about 0.0001 bit) never make a uniform NVFP4 miss a 4.5-bit budget."""
    return round(bits, 3) <= budget
