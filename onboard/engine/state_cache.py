"""Per-sequence state beside the paged KV cache: what a linear-attention layer carries from one
step to the next instead of a row per token.

A model with such layers declares a `StateLayout` (named tensors, each with its per-sequence
shape, dtype and the layers that hold it: Gated DeltaNet's conv window and its fp32 recurrent
state).  The runner allocates one tensor per name, `[layers holding it, num_slots, *shape]`.
`StateSlots` hands a slot to each sequence when the block manager allocates its blocks and takes
it back when they are freed (finished, aborted or preempted: a preempted sequence recomputes its
state from the start, as it recomputes its KV), so the slots are bounded by `max_num_seqs`.

A slot is not cleared when it is handed out: a layer reads its state only for a sequence that
has computed tokens before this step, and writes it whole on the sequence's first step.

Speculative decoding: a decoding sequence verifying draft tokens advances its state one token at
a time and keeps each position's state (`checkpoints`); once the target has accepted some, the
state after the last accepted token is copied back into the slot (vLLM keeps one per draft
position the same way).
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence tensor: `shape` per sequence in `dtype`, held by `layers`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layers: tuple[int, ...]

    @property
    def bytes_per_sequence(self) -> int:
        return math.prod(self.shape) * len(self.layers) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateLayout:
    tensors: tuple[StateSpec, ...]

    def bytes_per_sequence(self) -> int:
        return sum(t.bytes_per_sequence for t in self.tensors)

    def describe(self) -> dict[str, int]:
        """Bytes per sequence by state tensor (all layers)."""
        return {t.name: t.bytes_per_sequence for t in self.tensors}


class StateCache:
    """The state of every slot; `get(name, layer)` is `[num_slots, *shape]`."""

    def __init__(self, layout: StateLayout, num_slots: int, device: torch.device | str):
        self.layout = layout
        self.num_slots = num_slots
        self._by_layer: dict[str, dict[int, torch.Tensor]] = {}
        self.storage: dict[str, torch.Tensor] = {}
        for spec in layout.tensors:
            data = torch.zeros(len(spec.layers), num_slots, *spec.shape, dtype=spec.dtype, device=device)
            self.storage[spec.name] = data
            self._by_layer[spec.name] = {layer: data[i] for i, layer in enumerate(spec.layers)}

    def get(self, name: str, layer: int) -> torch.Tensor:
        return self._by_layer[name][layer]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage.values())


class StateSlots:
    """Which slot each sequence holds; the free ones in a deterministic order."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest first
        self._held: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq_id: int) -> int:
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id} already holds state slot {self._held[seq_id]}")
        if not self._free:
            raise RuntimeError(f"no free state slot for sequence {seq_id}")
        self._held[seq_id] = slot = self._free.pop()
        return slot

    def give_back(self, seq_id: int) -> None:
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_of(self, seq_id: int) -> int:
        return self._held[seq_id]

    def check(self, live_seq_ids: set[int]) -> list[str]:
        """What disagrees between the slots and the sequences that hold blocks."""
        errors = []
        if set(self._held) != live_seq_ids:
            errors.append(f"state slots held by {sorted(self._held)}, live sequences {sorted(live_seq_ids)}")
        if len(set(self._held.values())) != len(self._held) or set(self._held.values()) & set(self._free):
            errors.append("a state slot is held twice or both held and free")
        if len(self._held) + len(self._free) != self.num_slots:
            errors.append(f"held {len(self._held)} + free {len(self._free)} state slots != {self.num_slots}")
        return errors


@dataclass(frozen=True)
class StateSeq:
    """One scheduled sequence as a state layer sees it: rows [start, end) of the step, its slot,
    whether it has state from an earlier step, and whether it verifies draft tokens."""

    index: int  # in the step's sequence order
    start: int
    end: int
    slot: int
    continues: bool
    verifying: bool


def state_seqs(query_lens: list[int], context_lens: list[int], slots: list[int | None], decoding: list[bool]):
    """The step's sequences for the state layers (a `ForwardBatch`'s fields)."""
    out, start = [], 0
    for i, (q_len, ctx_len, slot) in enumerate(zip(query_lens, context_lens, slots, strict=True)):
        if slot is None:
            raise ValueError(f"sequence {i} of the step holds no state slot")
        continues = ctx_len > q_len
        verifying = continues and q_len > 1 and i < len(decoding) and decoding[i]
        out.append(StateSeq(i, start, start + q_len, slot, continues, verifying))
        start += q_len
    return out
