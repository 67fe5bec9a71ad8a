"""Qwen3-MoE: the qwen3 decoder (attention, norms, RoPE from llama.py) with a sparse MoE MLP.

Routing follows transformers' `Qwen3MoeTopKRouter`: router logits in the compute dtype, softmax in
float32, top-k, renormalized over the k when `norm_topk_prob`, cast back to the compute dtype.
The experts are the checkpoint's per-expert `mlp.experts.E.{gate,up,down}_proj` linears; only the
experts that received tokens run.  Each (token, slot) output is scaled by its routing weight in the
compute dtype and the k slots are summed with one `sum(dim=1)`, as transformers' default
`grouped_mm` experts path does.
"""

from typing import Any

import torch

from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.llama import LlamaModel


class Qwen3MoeSparseBlock(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = weights.linear(f"{prefix}.gate")
        self.experts = torch.nn.ModuleList(
            LlamaMLP(config, weights, f"{prefix}.experts.{e}") for e in range(self.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        k = self.top_k
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_w, top_e = torch.topk(probs, k, dim=-1)
        if self.norm_topk_prob:
            top_w /= top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(router_logits.dtype).view(-1, 1)  # [t*k, 1]
        flat_e = top_e.view(-1)
        order = torch.argsort(flat_e, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_e, minlength=self.num_experts).tolist()
        tokens = order // k
        out = x.new_empty(t * k, hidden)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            y = self.experts[e](x.index_select(0, tokens[start : start + count]))
            out.index_copy_(0, pairs, y * top_w.index_select(0, pairs))
            start += count
        return out.view(t, k, hidden).sum(dim=1)


class Qwen3MoeModel(LlamaModel):
    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        sparse = (
            layer_idx not in getattr(config, "mlp_only_layers", [])
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )
        return Qwen3MoeSparseBlock(config, weights, prefix) if sparse else LlamaMLP(config, weights, prefix)
