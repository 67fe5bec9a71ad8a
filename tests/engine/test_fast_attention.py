"""The fast backend's decode attention (`onboard/engine/attention/fast.py`) on a random paged cache.

A row's keys are padded to its own context rounded up to PAD_KEYS, so its result does not depend
on the rows batched with it: bitwise equal alone and batched, whatever the other contexts, on
scattered and on consecutive blocks; and it is attention (softmax(qK^T)V over its own context)."""

import math

import pytest
import torch

from onboard.engine.attention.fast import PAD_KEYS, FastBackend, decode_buckets, padded_keys
from onboard.engine.attention.metadata import AttentionMetadata
from onboard.engine.batch import ForwardBatch
from onboard.engine.kv_cache import KVCache, KVLayout

BLOCK, BLOCKS, KV_HEADS, HEADS, DIM = 16, 256, 3, 9, 64


def _cache(dtype: torch.dtype) -> KVCache:
    cache = KVCache(KVLayout.mha(1, KV_HEADS, DIM, dtype), BLOCKS, BLOCK, "cpu")
    gen = torch.Generator().manual_seed(0)
    for name in ("k", "v"):
        cache.storage[name].copy_(torch.randn(cache.storage[name].shape, generator=gen))
    return cache


def _meta(contexts: list[int], tables: list[list[int]]) -> AttentionMetadata:
    n = len(contexts)
    last_slots = [t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for c, t in zip(contexts, tables, strict=True)]
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.tensor([c - 1 for c in contexts]),
        slot_mapping=torch.tensor(last_slots),
        query_lens=[1] * n,
        context_lens=contexts,
        block_tables=tables,
        logits_indices=torch.arange(n),
        block_size=BLOCK,
    )
    return AttentionMetadata.build(batch, "cpu")


def _tables(contexts: list[int], seed: int) -> list[list[int]]:
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for c in contexts:
        n = -(-c // BLOCK)
        tables.append(order[used : used + n])
        used += n
    return tables


def _attention(q: torch.Tensor, cache: KVCache, context: int, table: list[int]) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V over the row's own context, in float64, K/V repeated per group."""
    k = cache.gather("k", 0, table, context).double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = cache.gather("v", 0, table, context).double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    weights = torch.einsum("hd,lhd->hl", q.double(), k).div(math.sqrt(DIM)).softmax(-1)
    return torch.einsum("hl,lhd->hd", weights, v)


def test_padded_keys_round_up_to_the_padding_step() -> None:
    assert [padded_keys(n) for n in (1, PAD_KEYS, PAD_KEYS + 1, 1000)] == [PAD_KEYS, PAD_KEYS, 2 * PAD_KEYS, 1024]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_attends_the_same_alone_and_batched(dtype: torch.dtype) -> None:
    cache = _cache(dtype)
    contexts = [37, 700, 64, 65, 5, 130, 38]
    tables = _tables(contexts, seed=1)
    q = torch.randn(len(contexts), HEADS, DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    backend = FastBackend("cpu")
    meta = _meta(contexts, tables)
    batched = backend.decode(q, 0, cache, meta, DIM**-0.5)
    buckets = decode_buckets(meta, BLOCKS)
    assert sorted(b.length for b in buckets) == sorted({padded_keys(c) for c in contexts})  # one call per length
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (context, table) in enumerate(zip(contexts, tables, strict=True)):
        alone = backend.decode(q[i : i + 1], 0, cache, _meta([context], [table]), DIM**-0.5)
        assert torch.equal(alone[0], batched[i])  # batch invariant, bit for bit
        torch.testing.assert_close(batched[i].double(), _attention(q[i], cache, context, table), atol=tolerance, rtol=0)


def test_a_lone_row_on_consecutive_blocks_reads_a_view_with_the_same_result() -> None:
    cache = _cache(torch.bfloat16)
    q = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    backend = FastBackend("cpu")
    consecutive = _meta([70], [[10, 11, 12, 13, 14]])
    assert decode_buckets(consecutive, BLOCKS)[0].block_range == (10, 10 + padded_keys(70) // BLOCK)
    scattered = [[10, 11, 12, 13, 200]]  # the same first four blocks, the fifth elsewhere
    cache.blocks("k", 0)[200].copy_(cache.blocks("k", 0)[14])
    cache.blocks("v", 0)[200].copy_(cache.blocks("v", 0)[14])
    via_view = backend.decode(q, 0, cache, consecutive, DIM**-0.5)
    via_gather = backend.decode(q, 0, cache, _meta([70], scattered), DIM**-0.5)
    assert decode_buckets(_meta([70], scattered), BLOCKS)[0].block_range is None
    assert torch.equal(via_view, via_gather)  # padding keys differ (masked): the result does not
