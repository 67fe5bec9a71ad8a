"""DeepSeek Sparse Attention's lightning indexer (deepseek_v32, glm_moe_dsa).

Every query scores every earlier key with a few small heads, and attends only to its top
`index_topk` keys.  The indexer caches one key per token (`index_k`, `index_head_dim` wide) in
its own paged tensor, on the layers that run an indexer.  Scores follow transformers 5.17's
`DeepseekV32Indexer` op for op, in float32:

    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * head_dim**-0.5),  w = weights_proj(x) * H**-0.5

with q from the attention's normed query latent (`wq_b`), k = LayerNorm(wk(x)), and RoPE on the
first `qk_rope_head_dim` dims of both: half-split on DeepSeek-V3.2, interleaved on GLM-5.
transformers computes the reference's bf16 equivalent: no Hadamard rotation (orthogonal, so dot
products are unchanged) and no FP8 scoring kernel.  A context no longer than `index_topk` selects
every key, so it is dense MLA exactly and the scores are skipped.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.attention import AttentionMetadata
from onboard.engine.context import StepContext
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.rope import apply_rotary, apply_rotary_interleaved


@dataclass
class Selection:
    """The keys each query of a step may attend to; None where that is every key (dense)."""

    decode: list[torch.Tensor] | None  # per decode row: sorted context positions
    prefill: list[torch.Tensor | None]  # per prefill sequence: [query_len, context_len] bool


def is_dsa(config: Any) -> bool:
    """Every layer of a DSA model attends sparsely (its own selection or a shared one)."""
    return getattr(config, "index_topk", None) is not None


def runs_indexer(config: Any, layer_idx: int) -> bool:
    """GLM-5's "shared" layers reuse the previous full layer's selection instead."""
    types = getattr(config, "indexer_types", None)
    return is_dsa(config) and (types is None or types[layer_idx] == "full")


class Indexer(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int, interleaved: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.interleaved = interleaved
        self.wq_b = weights.linear(f"{prefix}.wq_b")
        self.wk = weights.linear(f"{prefix}.wk")
        self.k_norm_weight = weights.tensor(f"{prefix}.k_norm.weight")
        self.k_norm_bias = weights.tensor(f"{prefix}.k_norm.bias")
        self.weights_proj = weights.linear(f"{prefix}.weights_proj")
        self.softmax_scale = self.head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        rot = apply_rotary_interleaved(rot, cos, sin) if self.interleaved else apply_rotary(rot, cos, sin)
        return torch.cat([rot, rest], dim=-1)

    def scores(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """`[S, L]` float32 scores of queries `q` `[S, H, D]` (head weights `w` `[S, H]`) against keys `k` `[L, D]`,
        as transformers' batched expression computes them (batch of one)."""
        scores = torch.matmul(q[None].float(), k[None].transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        scores = F.relu(scores)
        return torch.matmul(w[None].unsqueeze(-2), scores).squeeze(-2)[0]

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: StepContext) -> Selection:
        """Write the step's indexer keys, then pick each query's keys."""
        cos, sin = ctx.tables["cos"], ctx.tables["sin"]
        t = x.shape[0]
        k = F.layer_norm(self.wk.forward(x), (self.head_dim,), self.k_norm_weight, self.k_norm_bias, 1e-6)
        k = self._rope(k.view(t, 1, self.head_dim), cos, sin).view(t, self.head_dim)
        ctx.backend.write(ctx.cache, self.layer_idx, ctx.attn, index_k=k)
        q = self._rope(self.wq_b.forward(q_resid).view(t, self.n_heads, self.head_dim), cos, sin)
        w = self.weights_proj.forward(x).float() * (self.n_heads**-0.5)
        meta: AttentionMetadata = ctx.attn
        decode = None
        if meta.decode_rows is not None and any(length > self.topk for length in meta.decode_context_lens):
            rows = meta.decode_rows
            q_dec, w_dec = q[rows], w[rows]
            keys = ctx.cache.gather("index_k", self.layer_idx, meta.decode_blocks)
            decode = []
            for i, (start, length) in enumerate(zip(meta.decode_token_offsets, meta.decode_context_lens, strict=True)):
                if length <= self.topk:
                    decode.append(torch.arange(length, device=x.device))
                    continue
                row = self.scores(q_dec[i : i + 1], w_dec[i : i + 1], keys[start : start + length])
                decode.append(row[0].topk(self.topk).indices.sort().values)
        prefill: list[torch.Tensor | None] = []
        for i, seq in enumerate(meta.prefill):
            if seq.context_len <= self.topk:
                prefill.append(None)
                continue
            keys = (
                k[seq.start : seq.end]
                if seq.block_table is None
                else ctx.backend.context(ctx.cache, "index_k", self.layer_idx, seq)
            )
            mask = meta.explicit_causal_mask(i)
            scores = self.scores(q[seq.start : seq.end], w[seq.start : seq.end], keys).masked_fill(~mask, float("-inf"))
            chosen = scores.topk(self.topk, dim=-1).indices
            prefill.append(torch.zeros_like(mask).scatter_(-1, chosen, True) & mask)
        selection = Selection(decode, prefill)
        if ctx.trace is not None:
            ctx.trace.setdefault(self.layer_idx, []).append(selection)
        return selection
