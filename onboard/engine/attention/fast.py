"""The fast backend (fast numerics): decode rows bucketed by padded context, GQA folded into query rows.

Each KV head's query group runs as query rows of that head (`[kvh, group, d]` against
`[kvh, L, d]`): no repeat of K/V.  On the CPU that runs 3-6x faster than transformers' `enable_gqa`
call the exact backend makes.  The function is attention's, but its sums run in another order than
transformers': fast numerics is judged against exact by the near-tie rule (`onboard adapt`), not
bit for bit.

Batch invariance, by construction: a row's keys are padded to a length that depends on its own
context only (the next multiple of PAD_KEYS) and masked past it, and rows padded to the same
length share one call.  PyTorch's CPU flash-attention kernel computes each (row, head) of a call
alone, from that padded length, so a row's result does not depend on what else is batched.  (One
call padded to the step's longest context is not invariant: the kernel sums a context shorter
than its 512-key block in one block of the padded length, so 3 of 8 greedy demo requests changed
tokens batched; `fast_batched.py` serves that way without batch invariance.  One call per row was
the previous design: invariant too, but at 64 long sequences the per-row calls and their Python
were half a decode step.)  Draft proposals under verification attend row by row, as decode rows,
so speculative decoding gives plain decoding's tokens in fast numerics too.  A single sequence on
consecutive blocks reads its keys as a view.  Sliding windows and DSA selections take the generic
padded path.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onboard.engine.attention.base import AttentionBackend
from onboard.engine.attention.metadata import AttentionMetadata
from onboard.engine.attention.sdpa import padded_decode
from onboard.engine.kv_cache import KVCache

# Keys per padding step: 64 keys waste at most 63 per row and leave few distinct lengths per step
# (measured over 64 rows of 150-1500 keys: 21 calls, 2.5x faster than one call per row).
PAD_KEYS = 64


def padded_keys(context_len: int) -> int:
    """The key length a decode row attends over: its context, rounded up to PAD_KEYS."""
    return -(-context_len // PAD_KEYS) * PAD_KEYS


@dataclass
class DecodeBucket:
    """Decode rows padded to the same key length: one attention call."""

    rows: torch.Tensor | slice  # their indices among the step's decode rows
    blocks: torch.Tensor  # [n * length / block_size] block ids, row after row (filler: block 0)
    length: int
    keep: torch.Tensor  # [n, 1, 1, length] bool: the row's own context
    block_range: tuple[int, int] | None = None  # one row whose padded blocks are consecutive: a view
    _masks: dict | None = None

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive key mask in the queries' dtype (0 on the context, -inf past it)."""
        self._masks = self._masks or {}
        if dtype not in self._masks:
            zero = torch.zeros((), dtype=dtype, device=self.keep.device)
            self._masks[dtype] = torch.where(self.keep, zero, torch.tensor(float("-inf"), dtype=dtype))
        return self._masks[dtype]


def decode_buckets(meta: AttentionMetadata, num_blocks: int) -> list[DecodeBucket]:
    """The step's decode rows by padded key length, built once per step (every layer reuses them)."""
    cached = meta._derived.get("fast_buckets")
    if cached is not None:
        return cached
    block_size = meta.block_size
    tables = meta.decode_block_tables
    device = tables.device
    padded = [padded_keys(c) for c in meta.decode_context_lens]
    width = max(padded) // block_size
    if tables.shape[1] < width:
        tables = F.pad(tables, (0, width - tables.shape[1]))  # block 0: finite, and masked
    by_length: dict[int, list[int]] = {}
    for row, length in enumerate(padded):
        by_length.setdefault(length, []).append(row)
    buckets = []
    for length, rows in by_length.items():
        index = torch.tensor(rows, dtype=torch.long, device=device)
        lens = torch.tensor([meta.decode_context_lens[r] for r in rows], dtype=torch.long, device=device)
        keep = (torch.arange(length, device=device)[None, :] < lens[:, None])[:, None, None, :]
        blocks = tables[index, : length // block_size].reshape(-1)
        block_range = None
        if meta.decode_block_range is not None and meta.decode_block_range[0] + length // block_size <= num_blocks:
            block_range = (meta.decode_block_range[0], meta.decode_block_range[0] + length // block_size)
        rows_at = slice(0, len(rows)) if rows == list(range(len(rows))) else index
        buckets.append(DecodeBucket(rows_at, blocks, length, keep, block_range))
    meta._derived["fast_buckets"] = buckets
    return buckets


def _keys(cache: KVCache, name: str, layer: int, bucket: DecodeBucket, rows: int) -> torch.Tensor:
    """`[rows, kvh, length, d]` cached `name` of a bucket's rows (a strided view of the gathered blocks)."""
    source = cache.blocks(name, layer)
    if bucket.block_range is not None:
        first, last = bucket.block_range
        gathered = source[first:last]
    else:
        gathered = source.index_select(0, bucket.blocks)
    return gathered.view(rows, bucket.length, *source.shape[2:]).transpose(1, 2)


class FastBackend(AttentionBackend):
    name = "fast"
    rowwise_verification = True

    def decode(
        self, q, layer, cache, meta, scale, *, keys="k", values="v", value_dim=None, window=None, selected=None,
        fold_heads=False,
    ):  # fmt: skip
        if (window is not None and window < meta.decode_len) or selected is not None:
            return padded_decode(q, layer, cache, meta, scale, keys, values, value_dim, window, selected, True)
        num_rows, num_heads, head_dim = q.shape
        out = None
        for bucket in decode_buckets(meta, cache.num_blocks):
            rows = q[bucket.rows]
            n = rows.shape[0]
            k = _keys(cache, keys, layer, bucket, n)
            v = k[..., :value_dim] if values is None else _keys(cache, values, layer, bucket, n)
            kv_heads = k.shape[1]
            folded = rows.view(n, kv_heads, num_heads // kv_heads, head_dim)
            mask = bucket.mask(q.dtype)
            # 4-D inputs: PyTorch's fused CPU kernel (3-D inputs take its slow math path).  In float32
            # that kernel's rows change with how its threads split the batch (bf16's do not: measured
            # bitwise at 1-8 rows), so float32 keeps one call per row.
            if q.dtype == torch.float32 and q.device.type == "cpu" and n > 1:
                result = torch.cat(
                    [
                        F.scaled_dot_product_attention(
                            folded[j : j + 1], k[j : j + 1], v[j : j + 1], attn_mask=mask[j : j + 1], scale=scale
                        )
                        for j in range(n)
                    ]
                )
            else:
                result = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
            result = result.reshape(n, num_heads, -1)
            if isinstance(bucket.rows, slice) and n == num_rows:
                return result
            if out is None:
                out = q.new_empty(num_rows, num_heads, result.shape[-1])
            out[bucket.rows] = result
        return out
