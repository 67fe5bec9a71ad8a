"""Greedy speculative decoding on the paged cache: same tokens as plain greedy decoding, no leaked blocks."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from onboard.adapt.parity import compare_greedy
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.engine.spec_decode import SpeculativeDecoder
from onboard.speculator.draft import Eagle3Draft, draft_layer_config

ENGINE = EngineConfig(block_size=4, num_blocks=256, max_model_len=256, enable_prefix_caching=False)


def seeded_draft(path: Path, engine: LLMEngine, vocab: torch.Tensor, seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(path)
    draft = Eagle3Draft(draft_layer_config(config), len(vocab), [0, 1])
    draft.set_vocab(vocab)
    model = engine.runner.model
    head = model.lm_head.weight.float()
    draft.init_from_target(model.embed_tokens.float(), head, model.norm.weight.float())
    return draft.eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy(
    arch: str, k: int, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(arch)
    # Verification attends row by row exactly as decoding does.
    engine = LLMEngine(path, ENGINE, dtype=dtype)
    vocab_size = engine.runner.vocab_size
    # A draft vocabulary of every other id: some target choices are impossible to propose.
    draft = seeded_draft(path, engine, torch.arange(0, vocab_size, 2), seed=k)
    decoder = SpeculativeDecoder(engine, draft, k)
    gen = torch.Generator().manual_seed(7)
    accepted = []
    for length in (5, 12, 31):
        prompt = torch.randint(3, vocab_size, (length,), generator=gen).tolist()
        (plain,) = engine.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
        )
        spec = decoder.generate(prompt, 24)
        if dtype == torch.float32:
            assert spec.token_ids == plain.token_ids, (length, spec.accepted)
            assert [top[0] for top in spec.top] == spec.token_ids  # each token is the target's top-1
        else:
            # bf16: a K+1-row GEMM may round a few elements unlike a one-row GEMV (oneDNN picks
            # another kernel), so tokens may part at a near-tie, never elsewhere.
            plain_top = [[t for t, _ in entry["top"]] for entry in plain.logprobs]
            assert compare_greedy(spec.token_ids, plain.token_ids, spec.top, plain_top).near_tie, length
        assert all(0 <= a <= k for a in spec.accepted)
        # Every round emits its accepted proposals plus one token of the target's.
        assert sum(a + 1 for a in spec.accepted) >= len(spec.token_ids) - 1
        accepted += spec.accepted
        assert engine.block_manager.num_free_blocks == engine.config.num_blocks  # nothing leaked
    assert len(accepted) >= 3 * 23 // (k + 1)  # at most k + 1 tokens per target forward


class OracleDecoder(SpeculativeDecoder):
    """Proposes the known greedy continuation, wrong at every position divisible by 3."""

    def __init__(self, engine: LLMEngine, draft: Eagle3Draft, k: int, prompt: list[int], continuation: list[int]):
        super().__init__(engine, draft, k)
        self.known = prompt + continuation

    def _draft(self, tokens, aux, hidden, first_position, cache):
        logits, hidden = super()._draft(tokens, aux, hidden, first_position, cache)
        position = first_position + len(tokens)
        token = self.known[position] if position < len(self.known) else 0
        forced = torch.full_like(logits, -1e9)
        forced[token + 1 if position % 3 == 0 else token] = 0.0  # the full vocabulary: index == id
        return forced, hidden


@pytest.mark.parametrize("k", [2, 4])
def test_accepted_and_rejected_proposals_roll_back_exactly(tiny_llama: Path, k: int) -> None:
    engine = LLMEngine(tiny_llama, ENGINE, dtype=torch.float32)
    draft = seeded_draft(tiny_llama, engine, torch.arange(engine.runner.vocab_size), seed=0)
    prompt = list(range(10, 27))
    (plain,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    spec = OracleDecoder(engine, draft, k, prompt, plain.token_ids).generate(prompt, 40)
    assert spec.token_ids == plain.token_ids
    assert (max(spec.accepted) >= 2 and 0 in spec.accepted) or min(spec.accepted) < k  # full and partial rounds
    assert len(spec.accepted) < len(plain.token_ids) / 1.5  # far fewer target forwards than tokens
    assert engine.block_manager.num_free_blocks == engine.config.num_blocks


def test_speculative_sampling_is_distributed_as_plain_sampling(tiny_llama: Path) -> None:
    """Chi-square over the first two tokens (the second one speculative), 20,000 seeded samples each."""
    scipy_stats = pytest.importorskip("scipy.stats")
    engine = LLMEngine(tiny_llama, ENGINE, dtype=torch.float32)
    draft = seeded_draft(tiny_llama, engine, torch.arange(0, engine.runner.vocab_size, 2), seed=3)
    decoder = SpeculativeDecoder(engine, draft, 1)
    prompt = [5, 17, 99, 23, 250]
    samples = 20_000
    # Temperature 1.5 flattens these random models' distributions; top-k 4 keeps the table small.
    params = [SamplingParams(temperature=1.5, top_k=4, max_tokens=2, ignore_eos=True, seed=s) for s in range(samples)]
    plain = engine.generate([prompt] * samples, params)
    spec = [decoder.generate(prompt, 2, params=p).token_ids for p in params]
    pairs = sorted({tuple(c.token_ids) for c in plain} | {tuple(t) for t in spec})
    index = {pair: i for i, pair in enumerate(pairs)}
    table = torch.zeros(2, len(pairs))
    for c in plain:
        table[0, index[tuple(c.token_ids)]] += 1
    for t in spec:
        table[1, index[tuple(t)]] += 1
    table = table[:, table.sum(0) >= 10]  # chi-square needs populated cells
    result = scipy_stats.chi2_contingency(table.numpy())
    assert result.pvalue > 0.001, (result.pvalue, table)
