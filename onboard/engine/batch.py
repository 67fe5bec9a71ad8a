"""One forward step's inputs over the paged KV cache, as the model runner builds them."""

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """The new tokens of every scheduled sequence, flattened in order.

    Sequence i contributes `query_lens[i]` new tokens at positions
    `context_lens[i] - query_lens[i] .. context_lens[i] - 1`; its KV for all `context_lens[i]`
    tokens lives in the cache blocks `block_tables[i]` once this step has written the new ones
    to `slot_mapping` (flat slot = block * block_size + offset).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]  # [B]
    context_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B][num blocks of the sequence]
    logits_indices: torch.Tensor  # [S] int64: rows of the [T, H] hidden states to turn into logits
    block_size: int
    # Per sequence: its new tokens come after the whole prompt (a decode token plus draft
    # proposals to verify), so they are attended row by row, as decode steps attend.
    decoding: list[bool] = field(default_factory=list)
    # Per sequence: its slot in the per-sequence state (`state_cache.py`), where the model has one.
    state_slots: list[int | None] = field(default_factory=list)
