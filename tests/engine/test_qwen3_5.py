"""Qwen3.5 and Qwen3.5-MoE in the engine (Gated DeltaNet over the per-sequence state pool, output-gated attention
with partial RoPE, zero-centred norms) against transformers' torch path, in exact numerics:
prefill bit for bit, decode, prefill chunked across the delta rule's 64-token chunks and across
steps, preemption, rolled-back draft tokens, fast numerics, and every state slot given back."""

from pathlib import Path

import pytest
import torch
import transformers
from speculation import OracleSpeculator, seeded_draft

from onboard.adapt.parity import compare_greedy
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams

LENGTHS = (3, 17, 70, 130)  # shorter than the conv kernel, one chunk, two, three
NEW_TOKENS = 12
ENGINE = {"block_size": 4, "num_blocks": 256, "max_model_len": 256}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in LENGTHS]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module", params=["tiny_qwen3_5", "tiny_qwen3_5_moe"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    """The dense text model, and the MoE one (routed experts, a sigmoid-gated shared expert)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def reference(hf) -> list[list[int]]:
    """transformers' greedy continuations, each prompt alone."""
    out = []
    for prompt in prompts():
        tokens = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def engine(path: Path, **overrides) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{**ENGINE, **overrides}))


def drained(llm: LLMEngine) -> bool:
    llm._block_manager.check_invariants([])  # raises unless every block and state slot is back
    stats = llm.stats()
    return (
        not llm.has_unfinished()
        and stats["state_slots_used"] == 0
        and stats["num_free_blocks"] == llm.config.num_blocks
    )


def test_prefill_is_transformers_bit_for_bit(checkpoint: Path, hf) -> None:
    llm = engine(checkpoint)
    for prompt in prompts():
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        assert torch.equal(llm.score(prompt), want), len(prompt)
    stats = llm.stats()
    assert stats["prefix_caching"] is False  # a cached prefix would need the state at its end
    assert stats["state_bytes_per_sequence"] == 4096 + 1024  # fp32 [4, 16, 16] + bf16 [128, 4], one layer
    assert stats["kv_bytes_per_token"] == 2 * 2 * 16 * 2  # K and V of the one full-attention layer


def test_decode_and_chunked_prefill_follow_transformers(checkpoint: Path, hf, reference) -> None:
    """Prompts prefilled in 48-token steps (the state carried between them) and decoded: the
    tokens transformers gives, and the first token's log-probabilities those of transformers
    prefilling in the same chunks through its cache."""
    llm = engine(checkpoint, max_num_batched_tokens=48)
    outs = llm.generate(prompts(), greedy())
    assert [o.token_ids for o in outs] == reference
    prompt = prompts()[-1]
    (alone,) = llm.generate([prompt], greedy(logprobs=5))  # in steps of 48, 48 and 34 tokens
    first = alone.logprobs[0]
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        for start in range(0, len(prompt), 48):
            logits = hf(torch.tensor([prompt[start : start + 48]]), past_key_values=cache, use_cache=True).logits
    want = torch.log_softmax(logits[0, -1].float(), dim=-1)
    assert [t for t, _ in first["top"]] == want.topk(5).indices.tolist()
    assert [lp for _, lp in first["top"]] == pytest.approx(want.topk(5).values.tolist(), abs=1e-6)
    assert drained(llm)


def test_preempted_sequences_recompute_their_state(checkpoint: Path, reference) -> None:
    """Three prompts admitted in 24 of 28 blocks outgrow them while decoding."""
    llm = engine(checkpoint, num_blocks=28, max_model_len=112)
    outs = llm.generate(prompts()[:3], greedy())
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == reference[:3]
    assert drained(llm)


@pytest.mark.parametrize("k", [2, 4])
def test_rejected_draft_tokens_roll_the_state_back(checkpoint: Path, k: int) -> None:
    """Every verification accepts some proposals and rejects the rest: the state kept is the one
    after the last accepted token, so the tokens are plain decoding's (float32: a k + 1-row GEMM
    rounds as a 1-row one)."""
    llm = LLMEngine(checkpoint, EngineConfig(**ENGINE), dtype=torch.float32)
    prompt = prompts()[2]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (plain,) = llm.generate([prompt], params)
    draft = seeded_draft(checkpoint, llm, torch.arange(llm.vocab_size), seed=0)
    llm.speculator = OracleSpeculator(draft, k, prompt + plain.token_ids)
    (spec,) = llm.generate([prompt], params)
    assert spec.token_ids == plain.token_ids
    stats = llm.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert drained(llm) and llm._runner.state_checkpoints == {}


def test_fast_numerics_within_the_near_tie_rule_and_batch_invariant(checkpoint: Path, hf, reference) -> None:
    llm = engine(checkpoint, numerics="fast", max_num_batched_tokens=64)
    outs = llm.generate(prompts(), greedy(logprobs=5))
    for out, want, prompt in zip(outs, reference, prompts(), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
        reference_top = logits.float().topk(5).indices.tolist()
        engine_top = [[t for t, _ in entry["top"]] for entry in out.logprobs]
        assert compare_greedy(out.token_ids, want, engine_top, reference_top).near_tie
    assert drained(llm)
    # Batch invariant where each prompt is prefilled whole (a chunk boundary elsewhere rounds the
    # delta rule differently): the state layers decode the step's sequences in one batch, and
    # each row's bits are its lone decode's.
    llm = engine(checkpoint, numerics="fast")
    batched = llm.generate(prompts(), greedy(logprobs=5))
    for out, prompt in zip(batched, prompts(), strict=True):
        (alone,) = llm.generate([prompt], greedy(logprobs=5))
        assert alone.token_ids == out.token_ids and alone.logprobs == out.logprobs


def test_state_slots_are_given_back_over_a_thousand_requests(checkpoint: Path) -> None:
    """Finished, aborted and preempted sequences all give their slot back; 8 slots serve 1,000
    requests (fast numerics: one forward per step)."""
    llm = engine(checkpoint, numerics="fast", max_num_seqs=8, num_blocks=64, max_model_len=64)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=0)
    for i in range(1000):
        llm.add_request(
            torch.randint(3, 500, (int(torch.randint(2, 24, (1,), generator=gen)),), generator=gen).tolist(), params
        )
        if i % 7 == 0:
            llm.step()
        if i % 50 == 0 and llm._scheduler.running:
            llm.abort(llm._scheduler.running[-1].seq_id)
    while llm.has_unfinished():
        llm.step()
    assert drained(llm)
