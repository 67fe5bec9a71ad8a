"""Speculative decoding inside the engine: the same tokens as plain decoding (greedy), the same
distribution (sampling), exact rollback of rejected tokens in the KV cache, the prefix cache and
the grammar matcher, and nothing leaked."""

import itertools
import json
from pathlib import Path

import pytest
import torch
from speculation import OracleSpeculator, seeded_draft

from onboard.engine.config import EngineConfig
from onboard.engine.grammar import GrammarSpec
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.models import inspect_checkpoint, load_tokenizer

ENGINE = {"block_size": 4, "num_blocks": 256, "max_model_len": 256, "enable_prefix_caching": False}


def make_engine(path: Path, dtype: torch.dtype = torch.float32, **overrides) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{**ENGINE, **overrides}), dtype=dtype)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_drained(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine._block_manager.num_free_blocks == engine.config.num_blocks
    engine._block_manager.check_invariants([])
    assert engine.speculator is None or engine.speculator.states == {}


def top_ids(completion) -> list[list[int]]:
    return [[token for token, _ in entry["top"]] for entry in completion.logprobs]


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy(arch: str, k: int, dtype: torch.dtype, request) -> None:
    """In fast numerics, whose kernels are measured batch invariant on this machine. Exact numerics
    verifies k + 1 rows in one `F.linear` where plain decoding runs one, and oneDNN's AMX bf16
    kernels sum a row differently at the two counts: there the tokens may part after a tie."""
    path = request.getfixturevalue(arch)
    engine = make_engine(path, dtype, numerics="fast")
    vocab_size = engine.vocab_size
    prompts = random_prompts(vocab_size, (5, 12, 31))
    params = greedy(24, logprobs=5)
    plain = engine.generate(prompts, params)
    # A draft vocabulary of every other id: some target choices are impossible to propose.
    engine.set_speculator(seeded_draft(path, engine, torch.arange(0, vocab_size, 2), seed=k), k)
    for batch in ([prompts[0]], [prompts[1]], [prompts[2]], prompts):  # alone, and batched with the others
        spec = engine.generate(batch, params)
        for a, b in zip(spec, [plain[prompts.index(p)] for p in batch], strict=True):
            # Bit for bit in bf16 too: verification rows attend as decode rows and multiply batch invariantly.
            assert a.token_ids == b.token_ids
            if dtype == torch.float32:  # bf16 logits tie often in a tiny model; topk and argmax break ties apart
                assert [top[0] for top in top_ids(a)] == a.token_ids  # each token is the target's top-1
        assert_drained(engine)
    stats = engine.speculator.stats
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_drafts
    per_position = stats.accepted_per_position
    assert len(per_position) == k and sum(per_position) == stats.num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_position))  # position j+1 needs j accepted


@pytest.mark.parametrize("k", [2, 4])
def test_rejected_proposals_roll_back_exactly(tiny_llama: Path, k: int) -> None:
    """After rounds with every number of accepted proposals, the KV the sequence leaves in the
    prefix cache is the one plain decoding writes: a later request reusing it decodes the same."""
    engine = make_engine(tiny_llama, enable_prefix_caching=True)
    draft = seeded_draft(tiny_llama, engine, torch.arange(engine.vocab_size), seed=0)
    prompt = list(range(10, 27))
    (plain,) = engine.generate([prompt], greedy(40))
    fresh = make_engine(tiny_llama)  # nothing cached
    engine.speculator = OracleSpeculator(draft, k, prompt + plain.token_ids)
    (spec,) = engine.generate([prompt], greedy(40))
    assert spec.token_ids == plain.token_ids
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected rounds
    assert stats.num_drafts < len(plain.token_ids) / 1.5  # far fewer target forwards than tokens
    assert_drained(engine)

    # Blocks the speculative request registered hold verified tokens only, with their true KV.
    engine.set_speculator(None, 0)
    longer = prompt + spec.token_ids[:30]
    (reused,) = engine.generate([longer], greedy(12, logprobs=5))
    (cold,) = fresh.generate([longer], greedy(12, logprobs=5))
    assert engine._block_manager.hit_rate > 0
    assert reused.token_ids == cold.token_ids
    for a, b in zip(reused.logprobs, cold.logprobs, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_structured_output_with_speculation(tiny_llama: Path) -> None:
    """Grammar-constrained proposals, matcher rolled back after each verification: the same JSON
    as without speculation, and the grammar state ends where plain decoding's does."""
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["kind", "age"],
        "additionalProperties": False,
    }
    engine = make_engine(tiny_llama, num_blocks=512, max_model_len=512)
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    prompts = [tokenizer(text)["input_ids"] for text in ("A pet:", "Describe an animal as JSON.")]
    params = SamplingParams(temperature=0.0, max_tokens=200, frequency_penalty=2.0, presence_penalty=2.0)
    spec_grammar = GrammarSpec("json_schema", json.dumps(schema))
    plain = engine.generate(prompts, params, spec_grammar)
    engine.set_speculator(seeded_draft(tiny_llama, engine, torch.arange(engine.vocab_size), seed=1), 3)
    spec = engine.generate(prompts, params, spec_grammar)
    for a, b in zip(spec, plain, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
        value = json.loads(a.text)
        assert value["kind"] in ("cat", "dog") and 0 <= value["age"] <= 99
    assert engine.speculator.stats.num_draft_tokens > 0
    assert_drained(engine)


def test_speculative_sampling_is_distributed_as_plain_sampling(tiny_llama: Path) -> None:
    """Chi-square over the first two tokens (the second one speculative), 10,000 seeded samples each.
    Fast numerics, not batch invariant: the rejection rule does not depend on rounding, and exact
    numerics' one forward per sequence makes 20,000 sequences take minutes."""
    scipy_stats = pytest.importorskip("scipy.stats")
    engine = make_engine(
        tiny_llama, max_num_seqs=256, max_num_batched_tokens=4096, numerics="fast", batch_invariant=False
    )
    prompt = [5, 17, 99, 23, 250]
    samples = 10_000
    # Temperature 1.5 flattens these random models' distributions; top-k 4 keeps the table small.
    params = [SamplingParams(temperature=1.5, top_k=4, max_tokens=2, ignore_eos=True, seed=s) for s in range(samples)]
    plain = engine.generate([prompt] * samples, params)
    engine.set_speculator(seeded_draft(tiny_llama, engine, torch.arange(0, engine.vocab_size, 2), seed=3), 1)
    spec = engine.generate([prompt] * samples, params)
    assert engine.speculator.stats.num_drafts == samples
    pairs = sorted({tuple(c.token_ids) for c in plain} | {tuple(c.token_ids) for c in spec})
    index = {pair: i for i, pair in enumerate(pairs)}
    table = torch.zeros(2, len(pairs))
    for row, completions in enumerate((plain, spec)):
        for c in completions:
            table[row, index[tuple(c.token_ids)]] += 1
    table = table[:, table.sum(0) >= 10]  # chi-square needs populated cells
    result = scipy_stats.chi2_contingency(table.numpy())
    assert result.pvalue > 0.001, (result.pvalue, table)
    assert_drained(engine)


def test_the_draft_runs_in_the_models_dtype_on_a_copy(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, torch.bfloat16)
    draft = seeded_draft(tiny_llama, engine, torch.arange(engine.vocab_size), seed=0)  # float32, as trained
    engine.set_speculator(draft, 2)
    assert engine.speculator.draft.fc.weight.dtype == torch.bfloat16
    assert draft.fc.weight.dtype == torch.float32  # the caller's draft (exported as trained) is untouched
    (plain,) = make_engine(tiny_llama, torch.bfloat16).generate([list(range(3, 20))], greedy(12))
    (spec,) = engine.generate([list(range(3, 20))], greedy(12))
    assert spec.token_ids == plain.token_ids
