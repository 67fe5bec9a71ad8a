"""Output-gated grouped-query attention (Qwen3.5's and Qwen3-Next's full-attention layers).

`q_proj` emits each head's query and its gate side by side (`[heads, 2 * head dim]`); q and k
get zero-centred per-head RMSNorms, then partial RoPE; the attention output is multiplied by
sigmoid(gate) before `o_proj`.  K and V are cached per token as for llama (`mha_kv_tensors`).
"""

from typing import Any

import torch

from onboard.engine.context import StepContext
from onboard.engine.layers.mha import sliding_window
from onboard.engine.layers.norm import ZeroCenteredRMSNorm
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.rope import apply_rotary, head_dim_of


class GatedAttention(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.q_proj = weights.linear(f"{prefix}.q_proj")
        self.k_proj = weights.linear(f"{prefix}.k_proj")
        self.v_proj = weights.linear(f"{prefix}.v_proj")
        self.o_proj = weights.linear(f"{prefix}.o_proj")
        self.q_norm = ZeroCenteredRMSNorm(weights.tensor(f"{prefix}.q_norm.weight"), config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(weights.tensor(f"{prefix}.k_norm.weight"), config.rms_norm_eps)
        self.sliding_window = sliding_window(config, layer_idx)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        query, gate = torch.chunk(self.q_proj.forward(x).view(t, h, 2 * d), 2, dim=-1)
        gate = gate.reshape(t, h * d)
        q = self.q_norm.forward(query)
        k = self.k_norm.forward(self.k_proj.forward(x).view(t, kvh, d))
        v = self.v_proj.forward(x).view(t, kvh, d)
        cos, sin = ctx.tables["cos"], ctx.tables["sin"]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.backend.attend(q, k, v, self.layer_idx, ctx.cache, ctx.attn, self.scale, self.sliding_window)
        return self.o_proj.forward(out.reshape(t, h * d) * torch.sigmoid(gate))
