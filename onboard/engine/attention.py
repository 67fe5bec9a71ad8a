"""Causal attention over the paged KV cache, with torch's scaled_dot_product_attention.

`AttentionMetadata.build(batch, device)` turns a `ForwardBatch` into the index tensors and masks
one step needs; the model builds it once per forward and every layer reuses it.  Per layer,
`paged_attention` writes the step's new K/V into the cache and then attends:

* decode rows (sequences with one new token; all of a decode-only batch, or the decode part of a
  mixed batch).  On the CPU, one sequence or several: one gather of their blocks,
  then one unpadded SDPA call per sequence, transformers' own (`_decode_per_sequence`), the same
  computation whatever else is batched (batch invariance).  Elsewhere (CUDA, sliding
  windows): one padded `[B, kvh, L, d]` batch, ONE SDPA call, a key-padding mask hiding the padding;
* prefill rows (a sequence with several new tokens): one SDPA call per sequence.  A sequence whose
  whole context is new this step attends over its own new K/V with `is_causal=True` (nothing read
  back from the cache); one that continues a cached prefix (chunked prefill, prefix-cache hit)
  gathers its context from the cache and uses an explicit boolean mask, because its queries are the
  LAST `query_len` of `context_len` positions (SDPA's `is_causal` aligns them to the first).

Sliding windows (mistral, qwen2 sliding layers) add `key > query - window` to the masks, as
transformers' `sliding_window_overlay` does; all KV stays in the cache.
GQA uses SDPA's `enable_gqa=True` (no repeated K/V).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from onboard.engine.batch import ForwardBatch
from onboard.engine.kv_cache import KVCache


@dataclass
class _PrefillSeq:
    start: int  # rows [start, end) of the step's tokens
    end: int
    context_len: int
    block_table: torch.Tensor | None  # blocks holding the context; None when all of it is new this step
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal over the new tokens

    @property
    def query_len(self) -> int:
        return self.end - self.start


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one step, built once from a `ForwardBatch`."""

    slot_mapping: torch.Tensor  # [T]
    num_tokens: int
    block_size: int
    prefill: list[_PrefillSeq]
    # Decode group (sequences with one new token); None if there is none.
    decode_rows: torch.Tensor | slice | None = None  # their rows among the T tokens
    decode_block_tables: torch.Tensor | None = None  # [B, max blocks] (padded with block 0)
    decode_block_range: tuple[int, int] | None = None  # one sequence on consecutive blocks: read a view
    decode_context_lens: list[int] = field(default_factory=list)
    decode_len: int = 0  # keys per sequence after slicing the gathered blocks (the longest context)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, decode_len] bool; None: no padding
    # Every decode sequence's context blocks, concatenated, and where each sequence's tokens start in them.
    decode_blocks: torch.Tensor | None = None
    decode_token_offsets: list[int] = field(default_factory=list)
    _window_masks: dict = field(default_factory=dict)

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device | str) -> "AttentionMetadata":
        device = torch.device(device)
        block_size = batch.block_size
        prefill: list[_PrefillSeq] = []
        decode_rows: list[int] = []
        decode_ctx: list[int] = []  # per decode row: the context it attends over
        decode_tables: list[list[int]] = []
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
            end = start + q_len
            verifying = q_len > 1 and device.type == "cpu" and i < len(batch.decoding) and batch.decoding[i]
            if q_len == 1 or verifying:
                # Draft proposals to verify: each row attends exactly as a decode step at its
                # position would, so that verification gives bit for bit plain decoding's tokens.
                # (A prompt's continuation after a prefix-cache hit is not split so: its rows
                # must stay those of a fresh prefill.)
                for j in range(q_len):
                    decode_rows.append(start + j)
                    decode_ctx.append(ctx_len - q_len + j + 1)
                    decode_tables.append(batch.block_tables[i])
            elif q_len > 1:
                if ctx_len == q_len:
                    prefill.append(_PrefillSeq(start, end, ctx_len, None, None))
                else:
                    nblocks = -(-ctx_len // block_size)
                    table = torch.tensor(batch.block_tables[i][:nblocks], dtype=torch.long, device=device)
                    offset = ctx_len - q_len
                    mask = torch.arange(ctx_len, device=device)[None, :] <= (
                        torch.arange(q_len, device=device)[:, None] + offset
                    )
                    prefill.append(_PrefillSeq(start, end, ctx_len, table, mask))
            start = end
        meta = cls(
            slot_mapping=batch.slot_mapping.to(device, non_blocking=True),
            num_tokens=start,
            block_size=block_size,
            prefill=prefill,
        )
        if decode_rows:
            ctx = decode_ctx
            longest = max(ctx)
            nblocks = -(-longest // block_size)
            tables = [t[: -(-c // block_size)] for t, c in zip(decode_tables, ctx, strict=True)]
            tables = [t + [0] * (nblocks - len(t)) for t in tables]
            if len(tables) == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + nblocks)):
                meta.decode_block_range = (tables[0][0], tables[0][0] + nblocks)
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
            used = [t[: -(-c // block_size)] for t, c in zip(tables, ctx, strict=True)]
            meta.decode_blocks = torch.tensor([b for t in used for b in t], dtype=torch.long, device=device)
            meta.decode_token_offsets = [block_size * sum(map(len, used[:i])) for i in range(len(used))]
            meta.decode_context_lens = ctx
            meta.decode_len = longest
            if any(c != longest for c in ctx):
                lens = torch.tensor(ctx, dtype=torch.long, device=device)
                meta.decode_mask = (torch.arange(longest, device=device)[None, :] < lens[:, None])[:, None, None, :]
            first, last = decode_rows[0], decode_rows[-1]
            if last - first + 1 == len(decode_rows):
                meta.decode_rows = slice(first, last + 1)
            else:
                meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        return meta

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """The decode key mask, narrowed to the last `window` positions of each context."""
        if window is None or window >= self.decode_len:
            return self.decode_mask
        key = ("decode", window)
        if key not in self._window_masks:
            device = self.decode_block_tables.device
            lens = torch.tensor(self.decode_context_lens, dtype=torch.long, device=device)[:, None]
            pos = torch.arange(self.decode_len, device=device)[None, :]
            self._window_masks[key] = ((pos < lens) & (pos >= lens - window))[:, None, None, :]
        return self._window_masks[key]

    def prefill_mask_for(self, index: int, window: int | None) -> torch.Tensor | None:
        """The mask of prefill sequence `index` with a sliding window (None: `is_causal` suffices)."""
        seq = self.prefill[index]
        if window is None or window >= seq.context_len:
            return seq.mask
        key = ("prefill", index, window)
        if key not in self._window_masks:
            device = self.slot_mapping.device
            q_pos = torch.arange(seq.query_len, device=device)[:, None] + (seq.context_len - seq.query_len)
            k_pos = torch.arange(seq.context_len, device=device)[None, :]
            self._window_masks[key] = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return self._window_masks[key]


def _sdpa(q, k, v, mask, scale, is_causal, gqa):
    if gqa:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=True
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal)


def _decode_per_sequence(
    q_dec: torch.Tensor, layer: int, cache: KVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode attention as one unpadded SDPA call per sequence (`q_dec` `[B, h, d]` -> `[B, h, 1, d]`).

    On the CPU this is ~3x faster than one masked call over the padded batch, and a sequence's
    result does not depend on what else is in the batch; a lone sequence takes this path too.  The
    call is transformers' own (`enable_gqa`, no mask).  Folding each GQA group into the query axis
    would run 3 query rows per KV head and about 1.45x more tokens/s at 16 sequences on the demo
    model, but its sums round differently from transformers', and W4A4 activation quantization
    turns such last-bit differences into different tokens: parity with transformers goes first.
    """
    num_heads, head_dim = q_dec.shape[1], q_dec.shape[2]
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    # One gather of every sequence's blocks (a call per sequence costs more than the copy).
    shape = (-1, num_kv_heads, head_dim)
    keys = cache.k_caches[layer].index_select(0, meta.decode_blocks).view(shape).transpose(0, 1)
    values = cache.v_caches[layer].index_select(0, meta.decode_blocks).view(shape).transpose(0, 1)
    outs = []
    for i, (start, length) in enumerate(zip(meta.decode_token_offsets, meta.decode_context_lens, strict=True)):
        k = keys[None, :, start : start + length]  # [1, kvh, length, d]
        v = values[None, :, start : start + length]
        q_i = q_dec[i].view(1, num_heads, 1, head_dim)
        out = F.scaled_dot_product_attention(q_i, k, v, scale=scale, enable_gqa=group > 1)
        outs.append(out)
    return torch.cat(outs)


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    layer: int,
    cache: KVCache,
    batch: AttentionMetadata | ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write `k_new`/`v_new` (`[T, kvh, d]`) to the cache, attend `q` (`[T, h, d]`) causally over
    each sequence's full context; returns `[T, h, d]`.

    `batch` should be the step's `AttentionMetadata` (built once, shared by all layers); a
    `ForwardBatch` is accepted too and turned into one on the spot.
    """
    meta = batch if isinstance(batch, AttentionMetadata) else AttentionMetadata.build(batch, q.device)
    cache.write(layer, k_new, v_new, meta.slot_mapping)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_new.shape[1]
    gqa = num_heads != num_kv_heads

    decode_out = None
    if meta.decode_rows is not None:
        rows = meta.decode_rows
        q_dec = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
        tables = meta.decode_block_tables
        if q.device.type == "cpu" and sliding_window is None:
            out = _decode_per_sequence(q_dec, layer, cache, meta, scale)
        else:
            shape = (tables.shape[0], -1, num_kv_heads, head_dim)
            if meta.decode_block_range is not None:  # no copy
                first, last = meta.decode_block_range
                k = cache.k_caches[layer][first:last].view(shape)[:, : meta.decode_len]
                v = cache.v_caches[layer][first:last].view(shape)[:, : meta.decode_len]
            else:
                k = cache.k_caches[layer].index_select(0, tables.view(-1)).view(shape)[:, : meta.decode_len]
                v = cache.v_caches[layer].index_select(0, tables.view(-1)).view(shape)[:, : meta.decode_len]
            mask = meta.decode_mask_for(sliding_window)
            q_dec, k, v = q_dec.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2)
            out = _sdpa(q_dec, k, v, mask, scale, False, gqa)
        decode_out = out.squeeze(2)  # [B, h, d]
        if not meta.prefill:
            return decode_out

    outputs = []
    for i, seq in enumerate(meta.prefill):
        q_i = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, h, q_len, d]
        if seq.block_table is None:
            k_i = k_new[seq.start : seq.end]
            v_i = v_new[seq.start : seq.end]
        else:
            k_i = cache.k_caches[layer].index_select(0, seq.block_table).view(-1, num_kv_heads, head_dim)
            v_i = cache.v_caches[layer].index_select(0, seq.block_table).view(-1, num_kv_heads, head_dim)
            k_i, v_i = k_i[: seq.context_len], v_i[: seq.context_len]
        mask = meta.prefill_mask_for(i, sliding_window)
        is_causal = mask is None
        out = _sdpa(
            q_i, k_i.transpose(0, 1).unsqueeze(0), v_i.transpose(0, 1).unsqueeze(0), mask, scale, is_causal, gqa
        )
        outputs.append((seq, out[0].transpose(0, 1)))  # [q_len, h, d]

    if decode_out is None and len(outputs) == 1 and outputs[0][0].query_len == meta.num_tokens:
        return outputs[0][1]
    result = q.new_empty(meta.num_tokens, num_heads, head_dim)
    for seq, out in outputs:
        result[seq.start : seq.end] = out
    if decode_out is not None:
        if isinstance(meta.decode_rows, slice):
            result[meta.decode_rows] = decode_out
        else:
            result.index_copy_(0, meta.decode_rows, decode_out)
    return result
