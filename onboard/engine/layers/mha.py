"""Multi-head / grouped-query attention with RoPE (llama, mistral, qwen2, qwen3).

Caches K and V per token (`kv_tensors`).  q/k/v are one fused linear when the weight source can
fuse them; qwen3's per-head `q_norm`/`k_norm` RMSNorm before RoPE (used when the checkpoint has
them) runs as one norm over the fused q|k heads (a stacked per-head weight); MiniMax-M2's norms
over the whole q and k projections (a weight of `heads * head_dim`) run on each before the heads
are split.  RoPE rotates q and k in one pass.  Sliding window: per layer from
`config.layer_types` (qwen2/qwen3 style) or, without layer types, from `config.sliding_window`
(mistral).
"""

from typing import Any

import torch

from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVTensorSpec
from onboard.engine.layers.norm import RMSNorm
from onboard.engine.layers.weight_source import WeightSource, fused_or_split
from onboard.engine.rope import apply_rotary, head_dim_of


def sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def mha_kv_tensors(config: Any) -> list[KVTensorSpec]:
    layers = tuple(range(config.num_hidden_layers))
    shape = (config.num_key_value_heads, head_dim_of(config))
    return [KVTensorSpec("k", shape, layers), KVTensorSpec("v", shape, layers)]


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.qkv_proj, self.qkv_split = fused_or_split(weights, [f"{prefix}.{p}_proj" for p in "qkv"])
        if self.qkv_split is not None:
            self.qkv_split = torch.nn.ModuleList(self.qkv_split)
        self.o_proj = weights.linear(f"{prefix}.o_proj")
        self.qk_norm = self.q_norm = self.k_norm = None
        if weights.has(f"{prefix}.q_norm.weight"):
            q_w = weights.tensor(f"{prefix}.q_norm.weight")
            k_w = weights.tensor(f"{prefix}.k_norm.weight")
            if q_w.numel() == self.num_heads * self.head_dim != self.head_dim:  # minimax_m2: whole projection
                self.q_norm, self.k_norm = RMSNorm(q_w, config.rms_norm_eps), RMSNorm(k_w, config.rms_norm_eps)
            else:  # qwen3: per head
                stacked = torch.cat([q_w.expand(self.num_heads, -1), k_w.expand(self.num_kv_heads, -1)])
                self.qk_norm = RMSNorm(stacked.contiguous(), config.rms_norm_eps)
        self.sliding_window = sliding_window(config, layer_idx)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h = self.num_heads
        qk, v = self.rotated(x, ctx)
        out = ctx.backend.attend(
            qk[:, :h], qk[:, h:], v, self.layer_idx, ctx.cache, ctx.attn, self.scale, self.sliding_window
        )
        return self.o_proj.forward(out.reshape(x.shape[0], h * self.head_dim))

    def rotated(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k heads stacked `[T, h + kvh, d]`, normed and rotated; v `[T, kvh, d]`."""
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is not None:
            q, k, v = self._projections(x)
            qk = torch.cat([self.q_norm.forward(q).view(t, h, d), self.k_norm.forward(k).view(t, kvh, d)], dim=1)
            v = v.view(t, kvh, d)
        elif self.qkv_proj is not None:
            qkv = self.qkv_proj.forward(x).view(t, h + 2 * kvh, d)
            qk, v = qkv[:, : h + kvh], qkv[:, h + kvh :]
        else:
            q_proj, k_proj, v_proj = self.qkv_split
            qk = torch.cat([q_proj(x).view(t, h, d), k_proj(x).view(t, kvh, d)], dim=1)
            v = v_proj(x).view(t, kvh, d)
        if self.qk_norm is not None:
            qk = self.qk_norm.forward(qk)
        return apply_rotary(qk, ctx.tables["cos"], ctx.tables["sin"]), v

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, h*d]`, k and v `[T, kvh*d]`."""
        if self.qkv_proj is None:
            return tuple(proj(x) for proj in self.qkv_split)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.qkv_proj.forward(x).split([q_width, kv_width, kv_width], dim=-1)
