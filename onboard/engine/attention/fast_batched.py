"""The fast backend without batch invariance: every decode row of a step in ONE padded attention call.

Each row's keys are gathered into one `[B, kvh, L, d]` batch padded to the step's longest context,
a key mask hides the padding, and each KV head's query group runs as query rows of that head (as
`fast.py` folds them).  One call instead of one per row: at 16 sequences the per-row calls took
about a quarter of a decode step.  PyTorch's CPU flash-attention kernel sums a context shorter
than its 512-key block in one block of the padded length, so a row's result depends on the
longest context batched with it: this backend serves only with `EngineConfig.batch_invariant`
False.  A lone row, sliding windows, DSA selections and keys that are also values (MLA) take the
per-row backend's paths.
"""

import torch.nn.functional as F

from onboard.engine.attention.fast import FastBackend
from onboard.engine.attention.sdpa import padded_context


class FastBatchedBackend(FastBackend):
    name = "fast_batched"

    def decode(
        self, q, layer, cache, meta, scale, *, keys="k", values="v", value_dim=None, window=None, selected=None,
        fold_heads=False,
    ):  # fmt: skip
        if q.shape[0] == 1 or values is None or window is not None or selected is not None:
            return super().decode(
                q, layer, cache, meta, scale, keys=keys, values=values, value_dim=value_dim, window=window,
                selected=selected, fold_heads=fold_heads,
            )  # fmt: skip
        k = padded_context(cache, meta, keys, layer).transpose(1, 2)
        v = padded_context(cache, meta, values, layer).transpose(1, 2)
        rows, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        folded = q.view(rows, kv_heads, num_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=meta.decode_mask, scale=scale)
        return out.view(rows, num_heads, -1)
