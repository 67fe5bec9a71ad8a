"""What every family with per-sequence state (Qwen3.5's Gated DeltaNet, GLM-5.3-Flash's KDA) is
tested on in the engine, shared by `tests/engine/test_qwen3_5.py` and `test_glm5_next.py`: the
prompts (around the linear-attention chunk of 64 tokens), transformers' greedy reference, and the
checks of preemption, speculative rollback, fast numerics and slots given back."""

from collections.abc import Callable
from pathlib import Path

import torch
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


def engine(path: Path, dtype: torch.dtype = torch.bfloat16, **overrides) -> LLMEngine:
    return LLMEngine(path, EngineConfig(**{**ENGINE, **overrides}), dtype=dtype)


def greedy_reference(hf) -> list[list[int]]:
    """transformers' greedy continuations, each prompt alone."""
    out = []
    for prompt in prompts():
        tokens = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def drained(llm: LLMEngine) -> bool:
    llm._block_manager.check_invariants([])  # raises unless every block and state slot is back
    stats = llm.stats()
    return (
        not llm.has_unfinished()
        and stats.get("state_slots_used", 0) == 0  # a family without state has no slots
        and stats["num_free_blocks"] == llm.config.num_blocks
    )


def check_preemption(path: Path, reference: list[list[int]]) -> None:
    """Three prompts admitted in 24 of 28 blocks outgrow them while decoding."""
    llm = engine(path, num_blocks=28, max_model_len=112)
    outs = llm.generate(prompts()[:3], greedy())
    assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == reference[:3]
    assert drained(llm)


def check_rollback(path: Path, k: int, aux_layers: Callable[[LLMEngine], list[int]] | None = None) -> None:
    """Every verification accepts some proposals and rejects the rest: the state kept is the one
    after the last accepted token, so the tokens are plain decoding's (float32: a k + 1-row GEMM
    rounds as a 1-row one)."""
    llm = engine(path, torch.float32)
    prompt = prompts()[2]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (plain,) = llm.generate([prompt], params)
    extra = {} if aux_layers is None else {"aux_layers": aux_layers(llm)}
    draft = seeded_draft(path, llm, torch.arange(llm.vocab_size), seed=0, **extra)
    llm.speculator = OracleSpeculator(draft, k, prompt + plain.token_ids)
    (spec,) = llm.generate([prompt], params)
    assert spec.token_ids == plain.token_ids
    stats = llm.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert drained(llm) and llm._runner.state_checkpoints == {}


def check_fast_numerics(path: Path, hf, reference: list[list[int]]) -> None:
    """Fast numerics within the near-tie rule, chunked at 64 tokens; batch invariant where each
    prompt is prefilled whole (a chunk boundary elsewhere rounds the recurrence otherwise): the
    state layers decode the step's sequences in one batch, each row's bits its lone decode's."""
    llm = engine(path, numerics="fast", max_num_batched_tokens=64)
    outs = llm.generate(prompts(), greedy(logprobs=5))
    for out, want, prompt in zip(outs, reference, prompts(), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
        reference_top = logits.float().topk(5).indices.tolist()
        engine_top = [[t for t, _ in entry["top"]] for entry in out.logprobs]
        assert compare_greedy(out.token_ids, want, engine_top, reference_top).near_tie
    assert drained(llm)
    llm = engine(path, numerics="fast")
    batched = llm.generate(prompts(), greedy(logprobs=5))
    for out, prompt in zip(batched, prompts(), strict=True):
        (alone,) = llm.generate([prompt], greedy(logprobs=5))
        assert alone.token_ids == out.token_ids and alone.logprobs == out.logprobs


def check_slots_given_back(path: Path, requests: int = 320) -> None:
    """Finished, aborted and preempted sequences all give their slot back: 8 slots serve
    `requests` requests, 20 of them aborted mid-run (fast numerics: one forward per step). One slot
    kept per abort would leave none after 8."""
    llm = engine(path, numerics="fast", max_num_seqs=8, num_blocks=64, max_model_len=64)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=0)
    for i in range(requests):
        llm.add_request(
            torch.randint(3, 500, (int(torch.randint(2, 24, (1,), generator=gen)),), generator=gen).tolist(), params
        )
        if i % 7 == 0:
            llm.step()
        if i % (requests // 20) == 0 and llm._scheduler.running:
            llm.abort(llm._scheduler.running[-1].seq_id)
    while llm.has_unfinished():
        llm.step()
    assert drained(llm)
