"""What every layer's attention needs for one step, built once from a `ForwardBatch`.

Rows are split into two groups:

* decode rows: sequences with one new token (and, for backends that verify row by row, each
  row of a draft proposal being verified, attending exactly as a decode step at its position
  would);
* prefill sequences: several new tokens.  One whose whole context is new this step attends over
  its own new K/V with `is_causal=True`; one that continues a cached prefix (chunked prefill,
  prefix-cache hit) reads its context back and uses an explicit boolean mask, because its
  queries are the LAST `query_len` of `context_len` positions (SDPA's `is_causal` aligns them to
  the first).

Sliding windows (mistral, qwen2 sliding layers) add `key > query - window` to the masks, as
transformers' `sliding_window_overlay` does; all KV stays in the cache.
"""

from dataclasses import dataclass, field

import torch

from onboard.engine.batch import ForwardBatch


@dataclass
class PrefillSeq:
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
    prefill: list[PrefillSeq]
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
    def build(
        cls, batch: ForwardBatch, device: torch.device | str, rowwise_verification: bool = True
    ) -> "AttentionMetadata":
        """`rowwise_verification`: a decoding sequence's draft proposals attend as decode rows."""
        device = torch.device(device)
        block_size = batch.block_size
        prefill: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_ctx: list[int] = []  # per decode row: the context it attends over
        decode_tables: list[list[int]] = []
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
            end = start + q_len
            verifying = q_len > 1 and rowwise_verification and i < len(batch.decoding) and batch.decoding[i]
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
                    prefill.append(PrefillSeq(start, end, ctx_len, None, None))
                else:
                    nblocks = -(-ctx_len // block_size)
                    table = torch.tensor(batch.block_tables[i][:nblocks], dtype=torch.long, device=device)
                    offset = ctx_len - q_len
                    mask = torch.arange(ctx_len, device=device)[None, :] <= (
                        torch.arange(q_len, device=device)[:, None] + offset
                    )
                    prefill.append(PrefillSeq(start, end, ctx_len, table, mask))
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

    def explicit_causal_mask(self, index: int) -> torch.Tensor:
        """Prefill sequence `index`'s causal mask, materialized even where `is_causal` would do
        (DSA scores and masks every query explicitly, as transformers does)."""
        seq = self.prefill[index]
        if seq.mask is not None:
            return seq.mask
        key = ("causal", index)
        if key not in self._window_masks:
            ones = torch.ones(seq.query_len, seq.context_len, dtype=torch.bool, device=self.slot_mapping.device)
            self._window_masks[key] = ones.tril()
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
