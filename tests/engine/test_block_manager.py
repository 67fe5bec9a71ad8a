"""BlockManager: allocation, prefix caching (hash chain, computed-only hits, LRU eviction), invariants."""

import pytest

from onboard.engine.block_manager import BlockManager, BlockManagerCorrupted, block_hash, chain_hashes
from onboard.engine.sequence import Sequence

BS = 4


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, block_size=BS)


def admit(bm: BlockManager, tokens: list[int], *, computed: bool = True) -> Sequence:
    """Allocate a sequence and, like a finished prefill, mark all its tokens computed."""
    seq = seq_of(tokens)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    if computed:
        seq.num_computed_tokens = len(seq)
        bm.mark_computed(seq, len(seq))
    return seq


def test_allocate_and_deallocate_counts() -> None:
    bm = BlockManager(8, BS)
    seq = admit(bm, list(range(10)), computed=False)  # 3 blocks, last one partial
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert seq.num_cached_tokens == seq.num_computed_tokens == 0
    bm.check_invariants([seq])
    bm.deallocate(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants([])


def test_can_allocate_false_when_cache_too_small() -> None:
    bm = BlockManager(2, BS)
    assert not bm.can_allocate(seq_of(list(range(9))))
    with pytest.raises(RuntimeError):
        bm.allocate(seq_of(list(range(9))))
    assert bm.num_free_blocks == 2


def test_prefix_reuse_shares_full_blocks() -> None:
    bm = BlockManager(16, BS)
    prefix = list(range(100, 108))  # two full blocks
    a = admit(bm, [*prefix, 1, 2])
    b = admit(bm, [*prefix, 3, 4, 5], computed=False)
    assert b.num_cached_tokens == b.num_computed_tokens == 2 * BS
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.prefix_hits == 2 * BS and bm.prefix_queries == len(a) + len(b)
    assert bm.hit_rate == pytest.approx(8 / 21)
    bm.check_invariants([a, b])


def test_partial_last_block_is_never_shared() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = admit(bm, tokens)
    b = admit(bm, tokens)
    assert b.num_cached_tokens == 2 * BS
    assert b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[2]].hash is None  # partial blocks are never registered
    bm.check_invariants([a, b])


def test_last_prompt_token_is_always_recomputed() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(8))  # exactly two full blocks
    a = admit(bm, tokens)
    b = admit(bm, tokens, computed=False)
    # The last block holds the last token, whose logits are needed: it is not reused.
    assert b.num_computed_tokens == BS
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.check_invariants([a, b])


def test_hash_chain_depends_on_prefix() -> None:
    shared = [7, 7, 7, 7]
    first = chain_hashes([1, 2, 3, 4, *shared], BS, 2)
    second = chain_hashes([5, 6, 7, 8, *shared], BS, 2)
    assert first[1] != second[1]
    assert first[1] == block_hash(first[0], tuple(shared))

    bm = BlockManager(16, BS)
    admit(bm, [1, 2, 3, 4, *shared, 0])
    b = admit(bm, [5, 6, 7, 8, *shared, 0], computed=False)
    assert b.num_cached_tokens == 0


def test_hits_only_after_mark_computed() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(13))
    a = admit(bm, tokens, computed=False)
    assert admit(bm, tokens, computed=False).num_cached_tokens == 0
    bm.mark_computed(a, BS + 3)  # one full block written, the second only partly
    assert admit(bm, tokens, computed=False).num_cached_tokens == BS
    bm.mark_computed(a, 3 * BS)
    c = admit(bm, tokens, computed=False)
    assert c.num_cached_tokens == 3 * BS
    assert c.block_table[:3] == a.block_table[:3]


def test_decode_growth_registers_new_full_blocks() -> None:
    bm = BlockManager(16, BS)
    a = admit(bm, [1, 2, 3, 4, 5, 6])
    for token in (7, 8, 9):
        a.append_token(token)
        assert bm.can_append(a)
        bm.may_append(a)
        assert len(a.block_table) == a.num_blocks
        a.num_computed_tokens = len(a) - 1  # the sampled token's KV is written by the next step
        bm.mark_computed(a, a.num_computed_tokens)
    assert len(a.block_table) == 3
    b = admit(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0], computed=False)
    assert b.num_cached_tokens == 2 * BS
    bm.check_invariants([a, b])


def test_freed_blocks_stay_cached_and_are_revived() -> None:
    bm = BlockManager(4, BS)
    a = admit(bm, list(range(9)))  # 3 blocks, 2 registered
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = admit(bm, list(range(9)), computed=False)
    assert b.num_cached_tokens == 2 * BS
    assert bm.num_free_blocks == 1
    bm.check_invariants([b])


def test_lru_eviction_order_and_eviction_drops_hash() -> None:
    bm = BlockManager(6, BS)
    prompts = [[i] * BS + [99] for i in (1, 2, 3)]  # each: 1 registered full block + 1 partial
    seqs = [admit(bm, p) for p in prompts]
    cached = [s.block_table[0] for s in seqs]
    for s in seqs:
        bm.deallocate(s)  # frees 1, 2, 3 in that order
    # Uncached free blocks go first: the partial blocks.
    filler = admit(bm, [50] * (2 * BS + 1), computed=False)
    assert all(bm.blocks[b].hash is not None for b in cached)
    # Then the least recently freed cached block, and its hash leaves the table.
    evict_one = admit(bm, [60] * 3, computed=False)
    assert evict_one.block_table == [cached[0]]
    assert bm.blocks[cached[0]].hash is None
    assert len(bm.hash_to_block) == 2
    evict_two = admit(bm, [70] * 3, computed=False)
    assert evict_two.block_table == [cached[1]]
    bm.check_invariants([filler, evict_one, evict_two])
    for s in (filler, evict_one, evict_two):
        bm.deallocate(s)
    again = [admit(bm, p, computed=False) for p in (prompts[0], prompts[2])]
    assert [s.num_cached_tokens for s in again] == [0, BS]
    assert again[1].block_table[0] == cached[2]


def test_reused_block_moves_to_most_recently_freed() -> None:
    bm = BlockManager(5, BS)
    x, y = admit(bm, [1] * BS + [0]), admit(bm, [2] * BS + [0])
    bx, by = x.block_table[0], y.block_table[0]
    bm.deallocate(x)
    bm.deallocate(y)  # LRU: x then y
    bm.deallocate(admit(bm, [1] * BS + [0]))  # x revived and freed again: now y is the oldest
    z = admit(bm, [3] * (3 * BS))  # 3 uncached free blocks
    w = admit(bm, [4] * 3, computed=False)
    assert w.block_table == [by]
    assert bm.blocks[bx].hash is not None
    bm.check_invariants([z, w])


def test_hash_collision_is_guarded_by_tokens() -> None:
    bm = BlockManager(16, BS, hash_fn=lambda parent, tokens: 42)
    a = admit(bm, [1, 2, 3, 4, 0])
    b = admit(bm, [5, 6, 7, 8, 0], computed=False)
    assert b.num_cached_tokens == 0
    assert b.block_table[0] != a.block_table[0]
    c = admit(bm, [1, 2, 3, 4, 0], computed=False)
    assert c.num_cached_tokens == BS
    bm.check_invariants([a, b, c])


def test_equal_blocks_computed_twice_keep_one_cached_copy() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(9))
    a = admit(bm, tokens, computed=False)
    b = admit(bm, tokens, computed=False)
    for s in (a, b):
        s.num_computed_tokens = len(s)
        bm.mark_computed(s, len(s))
    assert len(bm.hash_to_block) == 2
    assert set(bm.hash_to_block.values()) == set(a.block_table[:2])
    bm.check_invariants([a, b])
    bm.deallocate(a)
    bm.deallocate(b)
    bm.check_invariants([])


@pytest.mark.parametrize("corruption", ["ref_count", "used_in_free_list", "duplicate_in_table", "hash_entry"])
def test_check_invariants_catches_corruption(corruption: str) -> None:
    bm = BlockManager(8, BS)
    a = admit(bm, list(range(9)))
    b = admit(bm, list(range(9)))
    bm.check_invariants([a, b])
    if corruption == "ref_count":
        bm.blocks[a.block_table[2]].ref_count += 1
    elif corruption == "used_in_free_list":
        bm._free_uncached.append(a.block_table[2])
    elif corruption == "duplicate_in_table":
        a.block_table[2] = a.block_table[1]
    else:
        h = bm.blocks[a.block_table[0]].hash
        bm.hash_to_block[h] = a.block_table[1]
    with pytest.raises(BlockManagerCorrupted):
        bm.check_invariants([a, b])


def test_check_invariants_with_no_live_sequences_requires_all_free() -> None:
    bm = BlockManager(4, BS)
    a = admit(bm, [1, 2])
    with pytest.raises(BlockManagerCorrupted, match="ref_count"):
        bm.check_invariants([])
    bm.deallocate(a)
    bm.check_invariants([])
