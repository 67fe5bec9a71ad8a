"""MiniMax-M2 (`minimax_m2`, M2 to M2.7): the llama decoder's grouped-query attention with RMSNorms
over the whole q and k projections (`layers/mha.py`) and partial rotary (`rope.py`), and a
sigmoid-routed MoE without groups or a shared expert, stored under Mixtral's names
(`block_sparse_moe.experts.E.w1/w3/w2`; llm-compressor's quantized artifact names them
`gate_proj/up_proj/down_proj` under the same block).

Routing follows transformers' `MiniMaxM2TopKRouter` op for op: the logits in the compute dtype
(`F.linear` of the input and the router weight as loaded), their sigmoid in float32, plus
`e_score_correction_bias` (as loaded: transformers keeps no float32 copy of it) for the choice
only, top-k with `sorted=False`, the chosen sigmoid scores renormalised, float32.
"""

from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.layers.deepseek_moe import router_weight
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.moe import run_experts
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.llama import LlamaModel

MIXTRAL_EXPERT = ("w1", "w3", "w2")  # gate, up, down: the release's names
LINEARIZED_EXPERT = ("gate_proj", "up_proj", "down_proj")  # llm-compressor's, in a quantized artifact


def expert_names(weights: WeightSource, prefix: str) -> tuple[str, str, str]:
    """The names the checkpoint stores an expert's linears under, Mixtral's or llm-compressor's."""
    first = f"{prefix}.experts.0.{MIXTRAL_EXPERT[0]}"
    stored = weights.has(f"{first}.weight") or weights.has(f"{first}.weight_packed")
    return MIXTRAL_EXPERT if stored else LINEARIZED_EXPERT


class MiniMaxM2SparseBlock(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, eager: bool):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.eager = eager
        self.gate_weight = torch.nn.Parameter(router_weight(weights, f"{prefix}.gate"), requires_grad=False)
        bias = f"{prefix}.e_score_correction_bias"
        correction = weights.tensor(bias) if weights.has(bias) else torch.zeros(self.num_experts)
        self.e_score_correction_bias = torch.nn.Parameter(correction.to(torch.float32), requires_grad=False)
        names = expert_names(weights, prefix)
        self.experts = torch.nn.ModuleList(
            LlamaMLP(config, weights, f"{prefix}.experts.{e}", expert=True, names=names)
            for e in range(self.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights float32 `[T, k]`, expert indices `[T, k]`) for `x` `[T, H]`."""
        scores = F.linear(x.to(self.gate_weight.dtype), self.gate_weight).float().sigmoid()
        _, indices = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)
        chosen = scores.gather(1, indices)
        return chosen / chosen.sum(dim=-1, keepdim=True), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.route(x)
        return run_experts(self.experts, x, weights, indices, self.eager)


class MiniMaxM2Model(LlamaModel):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        return MiniMaxM2SparseBlock(config, weights, prefix.removesuffix(".mlp") + ".block_sparse_moe", self.quantized)
