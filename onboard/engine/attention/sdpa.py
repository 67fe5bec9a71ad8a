"""The device-generic backend: every decode row of a step in ONE padded SDPA call.

The decode rows' blocks are gathered into one `[B, kvh, L, d]` batch (a single sequence on
consecutive blocks is read as a view, no copy) and a key mask hides the padding, the positions
outside a sliding window and, for DSA, the keys the indexer did not select.  Draft proposals
under verification attend as a prefill continuation (one masked call per sequence).  Fast on
accelerators; on the CPU its sums depend on the batch's longest context, so the exact backend
(`cpu.py`) serves there.
"""

import torch

from onboard.engine.attention.base import AttentionBackend, sdpa
from onboard.engine.attention.metadata import AttentionMetadata
from onboard.engine.kv_cache import KVCache


def padded_context(cache: KVCache, meta: AttentionMetadata, name: str, layer: int) -> torch.Tensor:
    """The decode rows' cached `name` rows, padded to the longest context: `[B, decode_len, *shape]`
    (a view when a single sequence sits on consecutive blocks)."""
    tables = meta.decode_block_tables
    source = cache.blocks(name, layer)
    shape = (tables.shape[0], -1, *source.shape[2:])
    if meta.decode_block_range is not None:  # no copy
        first, last = meta.decode_block_range
        return source[first:last].view(shape)[:, : meta.decode_len]
    return source.index_select(0, tables.view(-1)).view(shape)[:, : meta.decode_len]


def padded_decode(
    q: torch.Tensor,
    layer: int,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    keys: str,
    values: str | None,
    value_dim: int | None,
    window: int | None,
    selected: list[torch.Tensor] | None,
    fold_heads: bool = False,
) -> torch.Tensor:
    k = padded_context(cache, meta, keys, layer)
    v = k[..., :value_dim] if values is None else padded_context(cache, meta, values, layer)
    mask = meta.decode_mask_for(window)
    if selected is not None:
        chosen = torch.zeros(len(selected), meta.decode_len, dtype=torch.bool, device=q.device)
        for i, positions in enumerate(selected):
            chosen[i, positions] = True
        chosen = chosen[:, None, None, :]
        mask = chosen if mask is None else mask & chosen
    if fold_heads and k.shape[2] == 1:  # [B, 1, h, d] queries: every head a row of the one KV head
        return sdpa(q.unsqueeze(1), k.transpose(1, 2), v.transpose(1, 2), mask, scale, False).squeeze(1)
    out = sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, False)
    return out.squeeze(2)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    rowwise_verification = False

    def decode(
        self, q, layer, cache, meta, scale, *, keys="k", values="v", value_dim=None, window=None, selected=None,
        fold_heads=False,
    ):  # fmt: skip
        return padded_decode(q, layer, cache, meta, scale, keys, values, value_dim, window, selected, fold_heads)
