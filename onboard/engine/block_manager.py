"""Paged KV-cache bookkeeping with prefix caching.

A full block's hash chains its parent's hash with its tokens, so equal hashes mean equal prefixes
(up to hash collisions, which the stored tokens guard against). A block becomes reusable only once
its KV has been written (`mark_computed`); freed blocks keep their hash and stay reusable until a
fresh block is needed and they are evicted, least recently freed first.
"""

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from onboard.engine.sequence import Sequence
from onboard.engine.state_cache import StateSlots

ROOT_HASH = 0  # parent hash of a sequence's first block

HashFn = Callable[[int, tuple[int, ...]], int]


class BlockManagerCorrupted(RuntimeError):
    """The block manager's bookkeeping disagrees with itself or with the live sequences."""


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Stable 128-bit hash of (parent hash, block tokens)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.to_bytes(16, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int, hash_fn: HashFn = block_hash) -> list[int]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids`."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(num_blocks):
        parent = hash_fn(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set iff the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # of a registered block, to tell hash collisions apart


@dataclass
class _SeqState:
    hashes: list[int] = field(default_factory=list)  # chain hashes of leading full blocks
    num_marked: int = 0  # leading blocks already offered to the prefix cache


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, hash_fn: HashFn = block_hash, state_slots: StateSlots | None = None
    ):
        """`state_slots`: a model with per-sequence state (`state_cache.py`) gets a slot with its blocks."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.state_slots = state_slots
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest freed first
        self._seqs: dict[int, _SeqState] = {}
        self.prefix_hits = 0  # tokens found in the cache at admission
        self.prefix_queries = 0  # tokens looked up at admission

    # --- stats

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # --- admission

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Hashes of the blocks that may be reused, and the cached block ids of the leading hits."""
        # Only blocks ending before the last token: its logits are needed, so it is always recomputed.
        hashes = chain_hashes(seq.token_ids, self.block_size, (len(seq) - 1) // self.block_size, self.hash_fn)
        hits: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(block_id)
        return hashes, hits

    def _num_free_needed(self, seq: Sequence, hits: list[int]) -> int:
        num_revived = sum(self.blocks[b].ref_count == 0 for b in hits)  # cached hits sitting in the free list
        return seq.num_blocks - len(hits) + num_revived

    def can_allocate(self, seq: Sequence, *, reuse_prefix: bool = True) -> bool:
        if self.state_slots is not None and not self.state_slots.num_free:
            return False
        hits = self._lookup(seq)[1] if reuse_prefix else []
        return self._num_free_needed(seq, hits) <= self.num_free_blocks

    def allocate(self, seq: Sequence, *, reuse_prefix: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing the cached prefix; sets its computed/cached counts.

        `reuse_prefix=False` computes everything afresh (scoring every position needs it)."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        if seq.block_size != self.block_size:
            raise ValueError(f"sequence block_size {seq.block_size} != manager block_size {self.block_size}")
        hashes, hits = self._lookup(seq)
        if not reuse_prefix:
            hits = []
        if self._num_free_needed(seq, hits) > self.num_free_blocks:
            raise RuntimeError(f"not enough free blocks for sequence {seq.seq_id}")
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.take(seq.seq_id)
        # Take the hits off the free list before allocating fresh blocks, which could evict them.
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(seq.num_blocks - len(hits))]
        self._seqs[seq.seq_id] = _SeqState(hashes[: len(hits)], len(hits))
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        if reuse_prefix:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_cached_tokens

    def _take_free(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    # --- growth and computation

    def can_append(self, seq: Sequence) -> bool:
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Give `seq` a block for every token it holds (one more when its last token starts a block)."""
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free())

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register in the prefix cache the blocks of `seq` that are full and whose KV is written."""
        state = self._seqs[seq.seq_id]
        num_full = min(num_computed_tokens, len(seq)) // self.block_size
        if num_full > len(seq.block_table):
            raise ValueError(f"sequence {seq.seq_id}: {num_computed_tokens} tokens computed beyond its blocks")
        parent = state.hashes[-1] if state.hashes else ROOT_HASH
        for i in range(len(state.hashes), num_full):
            parent = self.hash_fn(parent, tuple(seq.block_tokens(i)))
            state.hashes.append(parent)
        for i in range(state.num_marked, num_full):
            block = self.blocks[seq.block_table[i]]
            # First writer wins: an equal block (or a colliding one) already registered stays the cached copy.
            if block.hash is None and state.hashes[i] not in self.hash_to_block:
                self.hash_to_block[state.hashes[i]] = block.block_id
                block.hash, block.token_ids = state.hashes[i], tuple(seq.block_tokens(i))
        state.num_marked = max(state.num_marked, num_full)

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks beyond what `seq`'s tokens need (rolled-back speculative tokens).
        Only blocks no other sequence shares and the prefix cache does not know can be cut."""
        while len(seq.block_table) > seq.num_blocks:
            block = self.blocks[seq.block_table[-1]]
            if block.ref_count != 1 or block.hash is not None:
                raise ValueError(f"sequence {seq.seq_id}: block {block.block_id} is shared or cached")
            seq.block_table.pop()
            block.ref_count = 0
            self._free_uncached.append(block.block_id)

    # --- release

    def deallocate(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least shareable, so they are evicted first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_uncached.append(block_id)
                else:
                    self._free_cached[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        self._seqs.pop(seq.seq_id, None)
        if self.state_slots is not None:
            self.state_slots.give_back(seq.seq_id)
            seq.state_slot = None

    # --- checks

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise `BlockManagerCorrupted` unless the bookkeeping agrees with `live_seqs`, the only block holders."""
        errors: list[str] = []
        expected_refs = [0] * self.num_blocks
        live_seqs = list(live_seqs)
        if self.state_slots is not None:
            errors += self.state_slots.check({seq.seq_id for seq in live_seqs})
        for seq in live_seqs:
            if len(set(seq.block_table)) != len(seq.block_table):
                errors.append(f"sequence {seq.seq_id} holds a block twice: {seq.block_table}")
            if len(seq.block_table) > seq.num_blocks:
                errors.append(f"sequence {seq.seq_id} holds {len(seq.block_table)} blocks for {len(seq)} tokens")
            for block_id in seq.block_table:
                if not 0 <= block_id < self.num_blocks:
                    errors.append(f"sequence {seq.seq_id} holds unknown block {block_id}")
                else:
                    expected_refs[block_id] += 1
        free_uncached, free_cached = set(self._free_uncached), set(self._free_cached)
        if len(free_uncached) != len(self._free_uncached):
            errors.append("a block is listed twice in the free list")
        if free_uncached & free_cached:
            errors.append(f"blocks in both free lists: {sorted(free_uncached & free_cached)}")
        free = free_uncached | free_cached
        num_used = 0
        for block in self.blocks:
            bid = block.block_id
            num_used += block.ref_count > 0
            if block.ref_count != expected_refs[bid]:
                errors.append(f"block {bid}: ref_count {block.ref_count}, held by {expected_refs[bid]} sequences")
            if block.ref_count > 0 and bid in free:
                errors.append(f"block {bid} is free and referenced (ref_count {block.ref_count})")
            if block.ref_count < 0:
                errors.append(f"block {bid}: negative ref_count {block.ref_count}")
            if block.hash is not None and self.hash_to_block.get(block.hash) != bid:
                errors.append(f"block {bid} has a hash the table does not map to it")
            if (bid in free_cached) != (bid in free and block.hash is not None):
                errors.append(f"block {bid} is in the wrong free list")
        for h, bid in self.hash_to_block.items():
            if not 0 <= bid < self.num_blocks or self.blocks[bid].hash != h:
                errors.append(f"hash table entry points to block {bid} whose hash differs")
        if len(free) + num_used != self.num_blocks:
            errors.append(f"free {len(free)} + used {num_used} != total {self.num_blocks}")
        if errors:
            raise BlockManagerCorrupted("; ".join(errors))
