"""Qwen3-MoE: the qwen3 decoder (attention, norms, RoPE from llama.py) with a sparse MoE MLP.

Routing follows transformers' `Qwen3MoeTopKRouter`: router logits in the compute dtype, softmax in
float32, top-k, renormalized over the k when `norm_topk_prob`, cast back to the compute dtype.
The experts are the checkpoint's per-expert `mlp.experts.E.{gate,up,down}_proj` linears, run by
`layers/moe.py` with transformers' default (grouped_mm) numerics, or the eager loop's for
quantized artifacts, as the reference `onboard.models.load_model` runs them.
"""

from typing import Any

import torch

from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.moe import run_experts
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.llama import LlamaModel


class Qwen3MoeSparseBlock(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, eager: bool):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)  # Qwen3.5-MoE always renormalises
        self.eager = eager
        self.gate = weights.linear(f"{prefix}.gate")
        self.experts = torch.nn.ModuleList(
            LlamaMLP(config, weights, f"{prefix}.experts.{e}", expert=True) for e in range(self.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_w, top_e = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w /= top_w.sum(dim=-1, keepdim=True)
        return run_experts(self.experts, x, top_w.to(router_logits.dtype), top_e, self.eager)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Qwen-MoE's rule (Qwen3-MoE, Qwen3-Next): experts unless `mlp_only_layers` names the layer or
    `decoder_sparse_step` skips it."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeModel(LlamaModel):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, weights, prefix)
        return Qwen3MoeSparseBlock(config, weights, prefix, eager=self.quantized)
