"""Scheduler: token budget, chunked prefill, FCFS, continuous batching, preemption, abort, and a seeded fuzz.

The "model" reads its context back from a simulated paged KV cache through the block tables, so a
wrong block table or a wrongly shared prefix block changes the generated tokens.
"""

import random

import pytest

from onboard.engine.block_manager import BlockManager, BlockManagerCorrupted
from onboard.engine.config import EngineConfig
from onboard.engine.scheduler import ScheduledSeq, Scheduler
from onboard.engine.sequence import Sequence, SequenceStatus

VOCAB = 97


def next_token(context: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(context)) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class CacheModel:
    """Writes each step's tokens into KV slots and samples from the context read back from them."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: list[list[int | None]] = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bm.block_size], pos % self.bm.block_size

    def step(self, scheduled: list[ScheduledSeq]) -> dict[int, int]:
        sampled = {}
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            for pos in range(start, end):
                block, offset = self.slot(seq, pos)
                # Never write into a block another sequence reads, nor one already in the prefix cache.
                assert self.bm.blocks[block].ref_count == 1 and self.bm.blocks[block].hash is None
                self.kv[block][offset] = seq.token_ids[pos]
            if item.samples:
                context = [self.kv[b][o] for b, o in (self.slot(seq, p) for p in range(end))]
                sampled[seq.seq_id] = next_token(context)
        return sampled


class Engine:
    """The engine's loop around the scheduler: step, then stop at max_tokens."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.bm = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.bm)
        self.model = CacheModel(self.bm)
        self.max_tokens: dict[int, int] = {}
        self.steps: list[list[tuple[int, int]]] = []  # (seq_id, num_new_tokens) per step

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        seq = Sequence(prompt, block_size=self.config.block_size)
        self.max_tokens[seq.seq_id] = max_tokens
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[ScheduledSeq]:
        scheduled = self.scheduler.schedule()
        assert sum(s.num_new_tokens for s in scheduled) <= self.config.max_num_batched_tokens
        assert len(scheduled) <= self.config.max_num_seqs
        assert all(s.num_new_tokens > 0 for s in scheduled)
        self.steps.append([(s.seq.seq_id, s.num_new_tokens) for s in scheduled])
        self.scheduler.postprocess(scheduled, self.model.step(scheduled))
        for item in scheduled:
            seq = item.seq
            done = len(seq.completion_token_ids) >= self.max_tokens[seq.seq_id] or len(seq) >= self.config.max_model_len
            if item.samples and not seq.is_finished and done:
                self.scheduler.finish(seq, "length")
        return scheduled

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("engine did not drain")


def config(**kwargs) -> EngineConfig:
    """Fast numerics' scheduling: prompts cut to any step's leftover budget (chunked prefill)."""
    defaults = dict(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return EngineConfig(**{**defaults, "numerics": "fast", **kwargs})


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_single_sequence_matches_reference() -> None:
    engine = Engine(config())
    seq = engine.add(prompt(10, 0), 6)
    engine.run()
    assert seq.completion_token_ids == reference(prompt(10, 0), 6)
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
    assert engine.bm.num_free_blocks == engine.config.num_blocks


def test_chunked_prefill_spreads_long_prompt() -> None:
    engine = Engine(config(max_num_batched_tokens=8))
    seq = engine.add(prompt(20, 1), 3)
    samples = [[s.samples for s in engine.step()] for _ in range(3)]
    assert engine.steps == [[(seq.seq_id, 8)], [(seq.seq_id, 8)], [(seq.seq_id, 4)]]
    assert samples == [[False], [False], [True]]
    assert len(seq.completion_token_ids) == 1
    engine.run()
    assert seq.completion_token_ids == reference(prompt(20, 1), 3)


def test_token_budget_and_seq_cap_respected() -> None:
    engine = Engine(config(max_num_batched_tokens=10, max_num_seqs=3))
    seqs = [engine.add(prompt(7, i), 5) for i in range(6)]
    engine.run()  # Engine.step asserts the budget and the cap
    assert max(sum(n for _, n in step) for step in engine.steps) == 10
    assert max(len(step) for step in engine.steps) == 3
    for i, seq in enumerate(seqs):
        assert seq.completion_token_ids == reference(prompt(7, i), 5)


def test_exact_numerics_admits_a_prompt_that_fits_in_a_step_whole() -> None:
    """A prompt is not cut to a step's leftover budget (its prefill would get other rows than
    alone); one longer than a whole step is chunked anyway."""
    engine = Engine(config(max_num_batched_tokens=10, max_num_seqs=3, numerics="exact"))
    seqs = [engine.add(prompt(7, i), 5) for i in range(3)] + [engine.add(prompt(25, 9), 2)]
    engine.run()
    first_chunks = {}
    for step in engine.steps:
        for seq_id, n in step:
            first_chunks.setdefault(seq_id, n)
    assert [first_chunks[s.seq_id] for s in seqs[:3]] == [7, 7, 7]
    assert first_chunks[seqs[3].seq_id] < 25
    for i, seq in enumerate(seqs[:3]):
        assert seq.completion_token_ids == reference(prompt(7, i), 5)
    assert seqs[3].completion_token_ids == reference(prompt(25, 9), 2)


def test_fcfs_admission_does_not_skip_ahead() -> None:
    engine = Engine(config(num_blocks=16, max_model_len=64))
    big = engine.add(prompt(40, 2), 20)  # 10 blocks, grows to 15
    blocked = engine.add(prompt(30, 3), 2)  # 8 blocks: does not fit next to big
    small = engine.add(prompt(3, 4), 2)  # 1 block: would fit, but must wait its turn
    engine.step()
    assert engine.scheduler.running == [big]
    assert list(engine.scheduler.waiting) == [blocked, small]
    engine.run()
    first_step = {sid: i for i, step in reversed(list(enumerate(engine.steps))) for sid, _ in step}
    assert first_step[big.seq_id] < first_step[blocked.seq_id] <= first_step[small.seq_id]
    assert blocked.completion_token_ids == reference(prompt(30, 3), 2)


def test_new_request_joins_while_others_decode() -> None:
    engine = Engine(config())
    a = engine.add(prompt(5, 5), 10)
    engine.step()
    engine.step()
    assert engine.steps[-1] == [(a.seq_id, 1)]  # decoding
    b = engine.add(prompt(6, 6), 4)
    engine.step()
    assert engine.steps[-1] == [(a.seq_id, 1), (b.seq_id, 6)]
    engine.step()
    assert engine.steps[-1] == [(a.seq_id, 1), (b.seq_id, 1)]
    engine.run()
    assert a.completion_token_ids == reference(prompt(5, 5), 10)
    assert b.completion_token_ids == reference(prompt(6, 6), 4)


def test_preemption_recomputes_and_finishes_with_same_tokens() -> None:
    engine = Engine(config(num_blocks=8, max_model_len=32))
    seqs = [engine.add(prompt(6, 10 + i), 14) for i in range(3)]  # 3 x 2 blocks, each grows to 5
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    for i, seq in enumerate(seqs):
        assert seq.completion_token_ids == reference(prompt(6, 10 + i), 14)
    assert engine.bm.num_free_blocks == 8
    engine.bm.check_invariants([])


def test_preemption_victim_is_latest_arrival_and_returns_first() -> None:
    engine = Engine(config(num_blocks=4, max_model_len=16))
    a = engine.add(prompt(4, 20), 8)  # 1 block, then a second on its first decode
    b = engine.add(prompt(4, 21), 8)
    c = engine.add(prompt(8, 22), 8)  # 2 blocks: fills the cache
    engine.step()
    assert engine.scheduler.running == [a, b, c]
    engine.step()  # a needs a block: c (latest) is preempted
    assert engine.scheduler.running == [a, b] and list(engine.scheduler.waiting) == [c]
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and len(c.completion_token_ids) == 1
    engine.run()
    for seq, seed in ((a, 20), (b, 21), (c, 22)):
        assert seq.completion_token_ids == reference(prompt(len(seq) - 8, seed), 8)


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    engine = Engine(config())
    shared = prompt(12, 30)
    a = engine.add([*shared, 1], 3)
    engine.run()
    b = engine.add([*shared, 2], 3)
    engine.step()
    assert b.num_cached_tokens == 12 and engine.steps[-1] == [(b.seq_id, 1)]
    engine.run()
    assert a.completion_token_ids == reference([*shared, 1], 3)
    assert b.completion_token_ids == reference([*shared, 2], 3)


@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode", "mid_step"])
def test_abort_frees_blocks(phase: str) -> None:
    engine = Engine(config(max_num_batched_tokens=8))
    other = engine.add(prompt(5, 40), 6)
    seq = engine.add(prompt(20, 41), 6)
    if phase == "prefill":
        engine.step()
        assert 0 < seq.num_computed_tokens < len(seq)
    elif phase == "decode":
        while len(seq.completion_token_ids) < 2:
            engine.step()
    if phase == "mid_step":
        engine.step()
        scheduled = engine.scheduler.schedule()
        sampled = engine.model.step(scheduled)
        assert engine.scheduler.abort(seq.seq_id)  # arrives while the model runs
        engine.scheduler.postprocess(scheduled, sampled)
    else:
        assert engine.scheduler.abort(seq.seq_id)
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    assert seq.block_table == []
    assert not engine.scheduler.abort(seq.seq_id)
    engine.bm.check_invariants(engine.scheduler.running)
    engine.run()
    assert other.completion_token_ids == reference(prompt(5, 40), 6)
    assert engine.bm.num_free_blocks == engine.config.num_blocks


def test_idle_schedule_checks_invariants() -> None:
    engine = Engine(config())
    engine.bm.blocks[3].ref_count = 1
    with pytest.raises(BlockManagerCorrupted):
        engine.scheduler.schedule()


def test_rejects_requests_that_cannot_fit() -> None:
    engine = Engine(config(max_model_len=16))
    with pytest.raises(ValueError):
        engine.add(prompt(17, 50), 1)
    with pytest.raises(ValueError):
        Scheduler(config(num_blocks=3, max_model_len=16), BlockManager(3, 4))


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_invariants_and_outputs(seed: int) -> None:
    rng = random.Random(seed)
    engine = Engine(
        config(
            num_blocks=12,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=rng.choice([6, 12, 24]),
            max_model_len=40,
        )
    )
    prefixes = [prompt(rng.choice([4, 8, 9]), 100 * seed + i) for i in range(3)]  # shared prefixes for cache hits
    requests: dict[int, tuple[Sequence, list[int], int]] = {}
    for _ in range(300):
        action = rng.random()
        if action < 0.15:
            prompt_ids = rng.choice(prefixes) + prompt(rng.randrange(1, 10), rng.randrange(10**6))
            max_tokens = rng.randrange(1, 40 - len(prompt_ids) + 1)
            seq = engine.add(prompt_ids, max_tokens)
            requests[seq.seq_id] = (seq, prompt_ids, max_tokens)
        elif action < 0.2 and requests:
            engine.scheduler.abort(rng.choice(list(requests)))
        else:
            engine.step()
        engine.bm.check_invariants(engine.scheduler.running)
        assert all(not s.block_table for s in engine.scheduler.waiting)
    engine.run()
    engine.scheduler.schedule()  # idle: checks every block is free
    assert engine.bm.num_free_blocks == engine.config.num_blocks
    for seq, prompt_ids, max_tokens in requests.values():
        assert seq.is_finished
        if seq.finish_reason != "abort":
            assert seq.completion_token_ids == reference(prompt_ids, max_tokens)
    assert engine.bm.prefix_hits > 0 and engine.scheduler.num_preemptions > 0


def test_fuzz_exercises_preemption() -> None:
    preemptions = 0
    for seed in range(6):
        rng = random.Random(seed)
        engine = Engine(config(num_blocks=12, max_num_seqs=4, max_model_len=40))
        for i in range(8):
            engine.add(prompt(rng.randrange(2, 12), 1000 * seed + i), rng.randrange(5, 25))
        engine.run()
        preemptions += engine.scheduler.num_preemptions
    assert preemptions > 0
