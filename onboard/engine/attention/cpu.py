"""The exact CPU backend: each decode row its own unpadded SDPA call, transformers' own.

One gather of every decode row's blocks, then one SDPA call per row over exactly its context
(`enable_gqa`, no mask): a sequence's result does not depend on what else is batched (batch
invariance), and a lone sequence computes what transformers computes.  On the CPU this is also
about 3x faster than one masked call over the padded batch.  Folding each GQA group into the
query axis would run 3 query rows per KV head and about 1.45x more tokens/s at 16 sequences on
the demo model, but its sums round differently from transformers', and W4A4 activation
quantization turns such last-bit differences into different tokens: parity goes first, so only
callers in fast numerics fold (`fold_heads`: MLA's absorbed decode, one cached head, where
`enable_gqa` over 8+ heads runs ~12x slower than the folded GEMM).  A row with a DSA selection
reads only its selected slots.  Draft proposals under verification attend row by row, as decode
steps would.  Sliding-window layers take the padded path (`sdpa.py`).
"""

import torch
import torch.nn.functional as F

from onboard.engine.attention.base import AttentionBackend
from onboard.engine.attention.sdpa import padded_decode


class CpuBackend(AttentionBackend):
    name = "cpu"
    rowwise_verification = True

    def decode(
        self, q, layer, cache, meta, scale, *, keys="k", values="v", value_dim=None, window=None, selected=None,
        fold_heads=False,
    ):  # fmt: skip
        if window is not None:
            return padded_decode(q, layer, cache, meta, scale, keys, values, value_dim, window, selected, fold_heads)
        if selected is None:
            key_rows = cache.gather(keys, layer, meta.decode_blocks)
            value_rows = None if values is None else cache.gather(values, layer, meta.decode_blocks)
        num_heads, head_dim = q.shape[1], q.shape[2]
        outs = []
        for i, (start, length) in enumerate(zip(meta.decode_token_offsets, meta.decode_context_lens, strict=True)):
            if selected is None:
                k, v = key_rows[start : start + length], None if values is None else value_rows[start : start + length]
            else:
                positions = selected[i]
                table = meta.decode_block_tables[i]
                slots = table[positions // meta.block_size] * meta.block_size + positions % meta.block_size
                k = cache.gather_slots(keys, layer, slots)
                v = None if values is None else cache.gather_slots(values, layer, slots)
            k = k.transpose(0, 1)[None]  # [1, kvh, length, d]
            v = k[..., :value_dim] if v is None else v.transpose(0, 1)[None]
            if fold_heads and k.shape[1] == 1:
                out = F.scaled_dot_product_attention(q[i].view(1, 1, num_heads, head_dim), k, v, scale=scale)
                outs.append(out.view(1, num_heads, 1, -1))
                continue
            q_i = q[i].view(1, num_heads, 1, head_dim)
            outs.append(F.scaled_dot_product_attention(q_i, k, v, scale=scale, enable_gqa=num_heads != k.shape[1]))
        return torch.cat(outs).squeeze(2)
