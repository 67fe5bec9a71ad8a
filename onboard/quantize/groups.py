"""Decision groups: the modules that must share one format because a serving engine fuses them.

vLLM runs q/k/v as one QKVParallelLinear and gate/up as one MergedColumnParallelLinear (one
kernel, one format, shared global scales), and all experts of a MoE layer as one fused kernel;
a selection that split them could not be served.

DeepSeek-style models (vllm/model_executor/models/deepseek_v2.py, read at vllm-project/vllm
002d6073): with q_lora_rank set, DeepseekV2MLAAttention runs q_a_proj and kv_a_proj_with_mqa as
one `fused_qkv_a_proj` (a MergedColumnParallelLinear), so they are one group; without it (the
V2-Lite form) q_proj and kv_a_proj_with_mqa are separate linears and separate groups.
q_b_proj, kv_b_proj and o_proj are each their own linear. Shared experts are a DeepseekV2MLP:
gate/up merged, down alone, so they split like a dense MLP (apart from the routed experts,
which the fused MoE kernel runs). The DSA indexer fuses wk with weights_proj (`wk_weights_proj`,
built with quant_config=None, always BF16) beside wq_b; recipes keep it all in BF16, and
should one quantize it, its linears form one group so that no selection splits them.
"""

import re
from dataclasses import dataclass

import torch

from onboard.evaluate.replay import LAYER
from onboard.quantize.schemes import SCHEMES

# Sibling Linear modules an engine runs as one kernel, by the kind of the fused module. A module
# joins its set only when a sibling of the set is there too (deepseek_v3 without q_lora_rank has
# q_proj and kv_a_proj_with_mqa but no k_proj or q_a_proj: each stays alone).
_FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "qkv_a": ("q_a_proj", "kv_a_proj_with_mqa"),
}
_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")
_INDEXER = re.compile(r"^(.*\.indexer)\.[^.]+$")
# Group kinds that are attention projections (standard and MLA), for rules such as "attention in FP8".
ATTENTION_KINDS = ("qkv", "o_proj", "qkv_a", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


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


def _key(name: str, linears: set[str]) -> tuple[str, str, str]:
    """(group name, kind, swap unit) of one quantized Linear module; `linears` names every Linear
    of the model, quantized or not, to tell which fused siblings exist."""
    experts = _EXPERTS.match(name)
    if experts:
        return experts.group(1), "experts", experts.group(1)
    indexer = _INDEXER.match(name)
    if indexer:
        return indexer.group(1), "indexer", name
    parent, _, leaf = name.rpartition(".")
    for kind, members in _FUSED.items():
        if leaf in members and any(f"{parent}.{m}" in linears for m in members if m != leaf):
            return f"{parent}.{kind}", kind, name
    return name, leaf, name


def _pattern(kind: str, name: str, modules: list[str]) -> str:
    if kind == "experts":
        return f"re:^{re.escape(name)}\\.\\d+\\..*"
    if len(modules) == 1:
        return f"re:^{re.escape(modules[0])}$"
    parent = re.escape(modules[0].rpartition(".")[0])
    leaves = "|".join(re.escape(m.rpartition(".")[2]) for m in modules)
    return f"re:^{parent}\\.({leaves})$"


def decision_groups(quantized: torch.nn.Module) -> list[Group]:
    """The groups of a model llmcompressor has quantized (every module with a scheme), in
    module order. Reading the quantized model, not the original, names MoE experts the way
    llmcompressor unfuses them."""
    found: dict[str, dict] = {}
    linears = {name for name, module in quantized.named_modules() if isinstance(module, torch.nn.Linear)}
    for name, module in quantized.named_modules():
        if getattr(module, "quantization_scheme", None) is None or not isinstance(module, torch.nn.Linear):
            continue
        group, kind, unit = _key(name, linears)
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
