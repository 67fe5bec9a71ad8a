"""GLM-5.3-Flash's DSA indexer over pooled keys (transformers' `Glm5NextTextIndexer`, `index_kpool`).

The lightning indexer of `dsa.py` (no RoPE here: the model is NoPE), but a query scores groups
of `index_kpool` consecutive keys instead of single ones.  Each complete group ("pool") of a
sequence's keys becomes one key: the softmax over the group of `gate + index_kpool_compress_ape`
(per channel, float32; gate = `index_kpool_compress_gate @ x`) weighs its keys, cast to the
compute dtype and summed.  A query scores the pools whose last key it sees, keeps the top
`index_topk / index_kpool`, and attends to their keys plus, with `index_kpool_always_select_tail`,
the keys of its own incomplete pool (the visible tail).  A context of at most `index_topk /
index_kpool` complete pools therefore attends densely.

The cache holds, per token and indexer layer, the key and its gate scores side by side
(`index_k`, `2 * index_head_dim`): transformers' packed indexer state without its padding
channel (the engine pads nothing).  Pools are rebuilt from them per sequence each step, as
transformers rebuilds them from its cache, so a chunked or decoded sequence scores the same pools
a whole prefill does.
"""

from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.attention import AttentionMetadata
from onboard.engine.context import StepContext
from onboard.engine.layers.dsa import Indexer, Selection
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.linear import EngineLinear


class PooledIndexer(Indexer):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        super().__init__(config, weights, prefix, layer_idx, interleaved=False)
        self.kpool = config.index_kpool
        self.select_tail = config.index_kpool_always_select_tail
        self.ape = weights.tensor(f"{prefix}.index_kpool_compress_ape")  # [kpool, head dim]
        # a plain parameter `[head dim, hidden]`, run as a linear (fast numerics' kernels)
        gate = weights.tensor(f"{prefix}.index_kpool_compress_gate")
        self.gate = EngineLinear(gate, name=f"{prefix}.index_kpool_compress_gate")

    def pooled(self, packed: torch.Tensor) -> torch.Tensor:
        """One sequence's cached `[L, 2 * head dim]` (key, gate) rows -> its complete pools' keys `[P, head dim]`."""
        pools = packed.shape[0] // self.kpool
        grouped = packed[: pools * self.kpool].view(1, pools, self.kpool, 2 * self.head_dim)
        keys, gates = grouped.split(self.head_dim, dim=-1)
        weights = (gates.float() + self.ape.float()[None, None]).softmax(dim=2).to(keys.dtype)
        return (weights * keys).sum(dim=2)[0]

    def chosen(self, q: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, last: int) -> torch.Tensor:
        """Which of the `L` keys each of the queries `q` `[S, H, D]` (positions `last - S + 1 .. last`)
        attends to: `[S, L]` bool."""
        length, rows = packed.shape[0], q.shape[0]
        pools = length // self.kpool
        positions = torch.arange(last - rows + 1, last + 1, device=q.device)[:, None]
        pool_end = torch.arange(pools, device=q.device)[None, :] * self.kpool + self.kpool - 1
        visible = pool_end <= positions  # a pool is a candidate once its last key is visible
        scores = self.scores(q, w, self.pooled(packed)).masked_fill(~visible, torch.finfo(torch.float32).min)
        picked = scores.topk(min(self.topk // self.kpool, pools), dim=-1).indices
        by_pool = torch.zeros_like(visible).scatter_(-1, picked, visible.gather(-1, picked))
        keys = torch.arange(length, device=q.device)[None, :]
        mask = F.pad(by_pool.repeat_interleave(self.kpool, dim=-1), (0, length - pools * self.kpool))
        if self.select_tail:  # the query's own incomplete pool
            mask |= (keys >= (positions + 1) // self.kpool * self.kpool) & (keys <= positions)
        return mask

    def dense(self, context_len: int) -> bool:
        """Whether every query of such a context attends to every key it sees."""
        return self.select_tail and context_len // self.kpool <= self.topk // self.kpool

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: StepContext) -> Selection:
        """Write the step's indexer keys and gate scores, then pick each query's keys."""
        t = x.shape[0]
        k = F.layer_norm(self.wk.forward(x), (self.head_dim,), self.k_norm_weight, self.k_norm_bias, 1e-6)
        packed = torch.cat([k, self.gate.forward(x)], dim=-1)
        ctx.backend.write(ctx.cache, self.layer_idx, ctx.attn, index_k=packed)
        q = self.wq_b.forward(q_resid).view(t, self.n_heads, self.head_dim)
        w = self.weights_proj.forward(x).float() * (self.n_heads**-0.5)
        meta: AttentionMetadata = ctx.attn
        decode = None
        if meta.decode_rows is not None and not all(self.dense(n) for n in meta.decode_context_lens):
            rows = meta.decode_rows
            q_dec, w_dec = q[rows], w[rows]
            cached = ctx.cache.gather("index_k", self.layer_idx, meta.decode_blocks)
            decode = []
            for i, (start, length) in enumerate(zip(meta.decode_token_offsets, meta.decode_context_lens, strict=True)):
                if self.dense(length):
                    decode.append(torch.arange(length, device=x.device))
                    continue
                mask = self.chosen(q_dec[i : i + 1], w_dec[i : i + 1], cached[start : start + length], length - 1)
                decode.append(mask[0].nonzero()[:, 0])
        prefill: list[torch.Tensor | None] = []
        for seq in meta.prefill:
            if self.dense(seq.context_len):
                prefill.append(None)
                continue
            cached = (
                packed[seq.start : seq.end]
                if seq.block_table is None
                else ctx.backend.context(ctx.cache, "index_k", self.layer_idx, seq)
            )
            rows = slice(seq.start, seq.end)
            prefill.append(self.chosen(q[rows], w[rows], cached, seq.context_len - 1))
        selection = Selection(decode, prefill)
        if ctx.trace is not None:
            ctx.trace.setdefault(self.layer_idx, []).append(selection)
        return selection
