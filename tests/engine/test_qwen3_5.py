"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next in the engine (Gated DeltaNet over the per-sequence state
pool, output-gated attention with partial RoPE, zero-centred norms) against transformers' torch
path, in exact numerics: prefill bit for bit, decode, prefill chunked across the delta rule's 64-token chunks and across
steps, preemption, rolled-back draft tokens, fast numerics, and every state slot given back."""

from pathlib import Path

import pytest
import torch
import transformers
from state_family import (
    check_fast_numerics,
    check_preemption,
    check_rollback,
    check_slots_given_back,
    drained,
    engine,
    greedy,
    greedy_reference,
    prompts,
)


@pytest.fixture(scope="module", params=["tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_qwen3_next"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    """The dense text model, the MoE one (routed experts, a sigmoid-gated shared expert), and
    Qwen3-Next (the MoE one's layers, Gated DeltaNet's projections fused as it stores them)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def reference(hf) -> list[list[int]]:
    return greedy_reference(hf)


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
    check_preemption(checkpoint, reference)


@pytest.mark.parametrize("k", [2, 4])
def test_rejected_draft_tokens_roll_the_state_back(checkpoint: Path, k: int) -> None:
    check_rollback(checkpoint, k)


def test_fast_numerics_within_the_near_tie_rule_and_batch_invariant(checkpoint: Path, hf, reference) -> None:
    check_fast_numerics(checkpoint, hf, reference)


def test_state_slots_are_given_back_over_a_thousand_requests(checkpoint: Path) -> None:
    check_slots_given_back(checkpoint, 1000)
