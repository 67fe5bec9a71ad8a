"""Grouped-query attention with a learned sink per query head (gpt-oss; DeepSeek-V4's layers have them too).

A sink is one more logit column per head: the softmax runs over the keys and the sink, the sink's
share is dropped, so a head can put weight on nothing.  No SDPA kernel takes a sink column, so this
layer computes attention itself, as transformers' eager `GptOssAttention` does it op for op (that
family supports no SDPA path): scores `q @ k^T * scale` in the compute dtype, plus the additive mask
(0 or the dtype's minimum), the sink column appended, the row maximum subtracted, softmax in the
compute dtype, the sink dropped, then `@ v`.  Prefill runs one `[1, h, q_len, L]` product per
sequence over its context read from the cache (a chunk sees its earlier chunks); each decode row one
`[1, h, 1, L]` product, over the last `sliding_window` keys on a sliding layer, which are the keys
transformers' sliding cache holds.  K and V are cached as plain MHA caches them; fast numerics take
the same path (no fused sink kernel is written).
"""

from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.attention.base import merge_rows
from onboard.engine.context import StepContext
from onboard.engine.layers.mha import LlamaAttention
from onboard.engine.layers.weight_source import WeightSource


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """q `[q_len, h, d]`, k and v `[L, kvh, d]`, `allowed` bool `[q_len, L]`, `sinks` `[h]` -> `[q_len, h, d]`."""
    h, kvh = q.shape[1], k.shape[1]
    query = q.transpose(0, 1)[None]  # [1, h, q, d]
    keys = k.transpose(0, 1)[None].repeat_interleave(h // kvh, dim=1)  # repeat_kv
    values = v.transpose(0, 1)[None].repeat_interleave(h // kvh, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    mask = torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device)
    scores = scores + mask.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(1, -1, q.shape[0], -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(values.dtype)
    return torch.matmul(probs, values)[0].transpose(0, 1)


class SinkAttention(LlamaAttention):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        super().__init__(config, weights, prefix, layer_idx)
        self.sinks = torch.nn.Parameter(weights.tensor(f"{prefix}.sinks"), requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h, window = x.shape[0], self.num_heads, self.sliding_window
        qk, v = self.rotated(x, ctx)
        q, k = qk[:, :h], qk[:, h:]
        meta, cache = ctx.attn, ctx.cache
        ctx.backend.write(cache, self.layer_idx, meta, k=k, v=v)
        decode_out = None
        if meta.decode_rows is not None:
            q_dec = q[meta.decode_rows]
            keys = cache.gather("k", self.layer_idx, meta.decode_blocks)
            values = cache.gather("v", self.layer_idx, meta.decode_blocks)
            outs = []
            for i, (start, length) in enumerate(zip(meta.decode_token_offsets, meta.decode_context_lens, strict=True)):
                first = start + max(0, length - window) if window is not None else start
                k_i, v_i = keys[first : start + length], values[first : start + length]
                allowed = torch.ones(1, k_i.shape[0], dtype=torch.bool, device=q.device)
                outs.append(sink_attention(q_dec[i : i + 1], k_i, v_i, allowed, self.scale, self.sinks))
            decode_out = torch.cat(outs)
        outputs = []
        for i, seq in enumerate(meta.prefill):
            if seq.block_table is None:
                k_i, v_i = k[seq.start : seq.end], v[seq.start : seq.end]
            else:
                k_i = ctx.backend.context(cache, "k", self.layer_idx, seq)
                v_i = ctx.backend.context(cache, "v", self.layer_idx, seq)
            allowed = meta.prefill_mask_for(i, window)
            allowed = meta.explicit_causal_mask(i) if allowed is None else allowed
            out = sink_attention(q[seq.start : seq.end], k_i, v_i, allowed, self.scale, self.sinks)
            outputs.append((seq, out))
        out = (
            decode_out if not meta.prefill else merge_rows(q.new_empty(t, h, self.head_dim), meta, outputs, decode_out)
        )
        return self.o_proj.forward(out.reshape(t, h * self.head_dim))
