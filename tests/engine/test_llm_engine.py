"""LLMEngine end to end on the tiny checkpoints: parity with transformers (bf16 and quantized
artifacts), prefix caching, continuous batching, abort, preemption, sampling, stops, grammars and
input validation.

Greedy parity in bf16 is checked token for token where the engine runs the same shapes as
transformers (one request at a time). Where the engine legitimately runs other shapes (batched
decode pads and masks, chunked prefill and recompute use explicit masks), bf16 logits may move by
an ulp, so a divergence is accepted only at a near-tie; the same scenarios also run in float32,
where such noise is far below any top-2 margin and the outputs must be identical.
"""

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch
from hf_reference import TOP, hf_greedy

from onboard.adapt.parity import GreedyComparison, compare_greedy, compare_logits
from onboard.engine.config import EngineConfig
from onboard.engine.grammar import GrammarSpec
from onboard.engine.llm_engine import Completion, LLMEngine, RequestOutput
from onboard.engine.sampler import SamplingParams
from onboard.engine.sequence import Sequence, SequenceStatus
from onboard.evaluate.kl import KLStats
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import Calibration, Quantize, recipe_for

ARCHS = ("tiny_llama", "tiny_qwen3", "tiny_qwen3_moe")
TEXTS = (
    "The weather today is",
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):",
    "Please answer the following question. What is the capital of France? The capital",
    "User: Can you write a function that reverses a string?\nAssistant:",
)
CALIB = Calibration(num_samples=2, max_seq_length=64)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def make_engine(path: Path, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> LLMEngine:
    settings = {"block_size": 4, "num_blocks": 256, "max_model_len": 256, **overrides}
    return LLMEngine(path, EngineConfig(**settings), dtype=dtype)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def top_ids(logprobs: list[dict]) -> list[list[int]]:
    return [[token for token, _ in entry["top"]] for entry in logprobs]


def compare(a: Completion, b: Completion) -> GreedyComparison:
    """Greedy comparison of two completions that carry top-5 logprobs."""
    return compare_greedy(a.token_ids, b.token_ids, top_ids(a.logprobs), top_ids(b.logprobs))


def assert_drained(engine: LLMEngine) -> None:
    """Nothing left in flight and every KV block back in the free lists."""
    assert not engine.has_unfinished()
    assert engine.requests == {}
    assert engine._scheduler.num_running == engine._scheduler.num_waiting == 0
    assert engine._block_manager.num_free_blocks == engine.config.num_blocks
    engine._block_manager.check_invariants([])


def text_prompts(path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(inspect_checkpoint(path))
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def corpus_ids(tiny_llama: Path) -> list[int]:
    """The tiny corpus as token ids (every tiny model shares the tokenizer): prompts of any length."""
    return load_tokenizer(inspect_checkpoint(tiny_llama))(tiny_models.CORPUS)["input_ids"]


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def run_steps(
    engine: LLMEngine,
    arrivals: dict[int, list[tuple[list[int], SamplingParams]]],
    on_step: Callable[[int], None] | None = None,
) -> tuple[dict[int, list[RequestOutput]], list[int]]:
    """Add requests at the given step numbers and step until everything finished.

    Returns every request's outputs by request id, and the request ids in arrival order."""
    outputs: dict[int, list[RequestOutput]] = {}
    order: list[int] = []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for prompt, params in arrivals.get(step, []):
            request_id = engine.add_request(prompt, params)
            outputs[request_id] = []
            order.append(request_id)
        for out in engine.step():
            assert not any(o.finished for o in outputs[out.request_id]), "output after the request finished"
            outputs[out.request_id].append(out)
        if on_step is not None:
            on_step(step)
        step += 1
        assert step < 10_000, "the engine does not make progress"
    return outputs, order


def as_completion(outs: list[RequestOutput]) -> Completion:
    return Completion(
        token_ids=[t for o in outs for t in o.new_token_ids],
        text="".join(o.new_text for o in outs),
        finish_reason=outs[-1].finish_reason if outs else None,
        logprobs=[lp for o in outs for lp in o.logprobs],
    )


def check_near_ties(name: str, got: list[Completion], want: list[Completion], exact: bool) -> int:
    """Every pair identical, or (bf16) diverging only at a near-tie; returns the exact matches."""
    verdicts = [compare(g, w) for g, w in zip(got, want, strict=True)]
    matched = sum(v.matched for v in verdicts)
    print(f"{name}: {matched}/{len(verdicts)} identical; divergences at {[v.first_divergence for v in verdicts]}")
    for i, verdict in enumerate(verdicts):
        assert len(got[i].token_ids) == len(want[i].token_ids), i
        if exact:
            assert verdict.matched, (i, got[i].token_ids, want[i].token_ids)
        else:
            assert verdict.near_tie, (i, verdict, got[i].token_ids, want[i].token_ids)
    return matched


# ---------------------------------------------------------------------------------------------
# Parity with transformers: bf16 checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_greedy_and_logits_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(arch)
    engine = make_engine(path, enable_prefix_caching=False)
    model = load_model(inspect_checkpoint(path))
    for prompt in text_prompts(path)[:3]:
        # One request per generate call: the shapes transformers runs, so the tokens must be equal.
        (mine,) = engine.generate([prompt], greedy(16))
        theirs, _ = hf_greedy(model, prompt, 16)
        # ignore_eos emits an EOS the model prefers, min_new_tokens suppresses it: only comparable without one.
        assert tiny_models.EOS_TOKEN_ID not in mine.token_ids
        assert mine.token_ids == theirs, (arch, prompt)
        assert mine.finish_reason == "length"

        ids = prompt + theirs
        got, want = engine.score(ids), hf_logits(model, ids)
        assert got.dtype == torch.float32
        assert got.shape == want.shape == (len(ids), tiny_models.VOCAB_SIZE)
        assert (got - want).abs().max() <= 1e-2, arch
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert_drained(engine)  # score() gives its blocks back too


# ---------------------------------------------------------------------------------------------
# Parity with transformers: quantized artifacts (compressed-tensors, via onboard's loader)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(quantized_run) -> Callable[[Path, Quantize], Path]:
    """The quantize stage's artifact for (checkpoint, settings), built once."""
    return lambda checkpoint_dir, settings: quantized_run(checkpoint_dir, settings) / "artifact"


def moe_recipe_settings() -> Quantize:
    recipe, _ = recipe_for(["Qwen3MoeForCausalLM"])
    return Quantize.model_validate({**recipe.quantize.model_dump(), "calibration": CALIB.model_dump()})


@pytest.mark.parametrize(
    ("arch", "scheme"),
    [("tiny_llama", "nvfp4"), ("tiny_llama", "fp8"), ("tiny_qwen3_moe", "nvfp4")],
    ids=["llama-nvfp4", "llama-fp8", "qwen3_moe-nvfp4"],
)
def test_quantized_artifact_matches_transformers(
    arch: str, scheme: str, quantized, request: pytest.FixtureRequest
) -> None:
    original = request.getfixturevalue(arch)
    settings = moe_recipe_settings() if arch == "tiny_qwen3_moe" else Quantize(scheme=scheme, calibration=CALIB)
    artifact = quantized(original, settings)
    engine = make_engine(artifact, enable_prefix_caching=False)
    model = load_model(inspect_checkpoint(artifact))
    bf16 = load_model(inspect_checkpoint(original))

    stats = KLStats()
    max_diff = 0.0
    verdicts = []
    for prompt in text_prompts(original):
        (mine,) = engine.generate([prompt], greedy(16, logprobs=TOP))
        theirs, their_top = hf_greedy(model, prompt, 16)
        verdicts.append(compare_greedy(mine.token_ids, theirs, top_ids(mine.logprobs), their_top))
        ids = prompt + theirs
        want = hf_logits(model, ids)
        max_diff = max(max_diff, compare_logits(engine.score(ids), want, stats))
        # The artifact really is quantized: it is not the bf16 model.
        assert (want - hf_logits(bf16, ids)).abs().max() > 0.05
    summary = stats.summary()
    match_rate = sum(v.matched for v in verdicts) / len(verdicts)
    print(
        f"{arch} {scheme}: top1 {summary['top1_agreement']:.4f}, mean KL {summary['mean_kld']:.3e}, "
        f"max |d logit| {max_diff:.4f}, greedy match {match_rate:.2f} over {summary['num_tokens']} positions"
    )
    assert summary["top1_agreement"] >= 0.99
    assert summary["mean_kld"] < 1e-3
    assert match_rate >= 0.75
    assert all(v.near_tie for v in verdicts), verdicts
    assert_drained(engine)


# ---------------------------------------------------------------------------------------------
# Prefix caching
# ---------------------------------------------------------------------------------------------


def test_prefix_cache_reuses_a_finished_requests_blocks(tiny_llama: Path, corpus_ids: list[int]) -> None:
    block = 4
    shared = corpus_ids[:16]  # 4 full blocks
    first = shared + corpus_ids[100:105]
    second = shared + corpus_ids[200:205]
    warm = make_engine(tiny_llama, block_size=block, num_blocks=64, max_model_len=128, enable_prefix_caching=True)
    cold = make_engine(tiny_llama, block_size=block, num_blocks=64, max_model_len=128, enable_prefix_caching=False)

    def run_one(prompt: list[int]) -> tuple[Completion, int]:
        """Generate alone; returns the completion and the prompt tokens found in the cache at admission."""
        request_id = warm.add_request(prompt, greedy(12))
        outs = warm.step()  # admission: blocks allocated, cached prefix found
        seq = next(s for s in warm._scheduler.running if s.seq_id == request_id)
        cached = seq.num_cached_tokens
        assert seq.num_computed_tokens == len(prompt)  # the cached part was not recomputed
        while warm.has_unfinished():
            outs += warm.step()
        return as_completion(outs), cached

    a, cached_a = run_one(first)
    assert cached_a == 0
    b, cached_b = run_one(second)
    assert cached_b == len(shared)  # the 4 shared blocks, not the diverging one
    # The first request's generated tokens were cached too: every full block whose KV was written
    # (21 prompt + 11 decoded tokens = 8 blocks; the last sampled token never had KV computed).
    third = first + a.token_ids[:11] + corpus_ids[300:302]
    c, cached_c = run_one(third)
    assert cached_c == 8 * block

    assert warm._block_manager.hit_rate == pytest.approx((0 + 16 + 32) / (len(first) + len(second) + len(third)))
    assert warm._block_manager.hit_rate > 0
    for completion, prompt in ((a, first), (b, second), (c, third)):
        (expected,) = cold.generate([prompt], greedy(12))
        assert completion.token_ids == expected.token_ids
        assert completion.finish_reason == expected.finish_reason == "length"
    assert cold._block_manager.hit_rate == 0.0
    assert_drained(warm)
    assert_drained(cold)


# ---------------------------------------------------------------------------------------------
# Continuous batching
# ---------------------------------------------------------------------------------------------

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3_moe"])
def test_continuous_batching_with_staggered_arrivals(
    arch: str, dtype: torch.dtype, request: pytest.FixtureRequest, corpus_ids: list[int]
) -> None:
    path = request.getfixturevalue(arch)
    lengths = [5, 9, 14, 20, 27, 33, 41, 50]
    max_tokens = [7, 16, 3, 12, 1, 20, 9, 14]
    prompts = [corpus_ids[100 * i : 100 * i + n] for i, n in enumerate(lengths)]
    params = [greedy(m, logprobs=TOP) for m in max_tokens]

    solo_engine = make_engine(path, dtype, enable_prefix_caching=False)
    solo = [solo_engine.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]

    # A small token budget: long prompts prefill in chunks, next to other sequences' decodes.
    engine = make_engine(path, dtype, enable_prefix_caching=False, max_num_batched_tokens=24)
    added = {0: [0, 1, 2], 2: [3, 4], 5: [5], 6: [6, 7]}
    arrivals = {step: [(prompts[i], params[i]) for i in idx] for step, idx in added.items()}
    concurrency: list[int] = []
    outputs, order = run_steps(engine, arrivals, lambda _: concurrency.append(engine._scheduler.num_running))
    assert max(concurrency) >= 4

    batched = []
    for i, request_id in enumerate(order):
        outs = outputs[request_id]
        assert [o.finished for o in outs] == [False] * (max_tokens[i] - 1) + [True]
        assert [o.num_completion_tokens for o in outs] == list(range(1, max_tokens[i] + 1))
        assert {o.num_prompt_tokens for o in outs} == {lengths[i]}
        completion = as_completion(outs)
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == max_tokens[i]
        batched.append(completion)
    check_near_ties(f"batching {arch} {dtype}", batched, solo, exact=dtype == torch.float32)
    assert_drained(engine)


# ---------------------------------------------------------------------------------------------
# Abort and preemption
# ---------------------------------------------------------------------------------------------


def test_abort_while_waiting_prefilling_and_decoding(tiny_llama: Path, corpus_ids: list[int]) -> None:
    config = dict(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=8, max_num_seqs=3)
    engine = make_engine(tiny_llama, enable_prefix_caching=True, **config)
    prompts = [corpus_ids[50 * i : 50 * i + 18 + i] for i in range(6)]
    prompts[4] = prompts[0][:16] + corpus_ids[900:905]  # shares 4 blocks with the one aborted mid-prefill
    params = greedy(10, logprobs=TOP)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs: dict[int, Sequence] = {s.seq_id: s for s in engine._scheduler.waiting}
    assert set(seqs) == set(ids)
    outputs: dict[int, list[RequestOutput]] = {i: [] for i in ids}
    aborted: dict[int, str] = {}

    def step() -> None:
        for out in engine.step():
            assert out.request_id not in aborted, "an aborted request produced output"
            outputs[out.request_id].append(out)

    def abort(request_id: int, when: str) -> None:
        engine.abort(request_id)
        aborted[request_id] = when
        seq = seqs[request_id]
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
        assert seq.block_table == []
        assert seq not in engine._scheduler.running and seq not in engine._scheduler.waiting
        engine._block_manager.check_invariants(engine._scheduler.running)

    # Waiting: never scheduled, holds no blocks.
    assert seqs[ids[5]].status is SequenceStatus.WAITING
    abort(ids[5], "waiting")

    # Mid-prefill: 8-token budget, so an 18-token prompt takes three steps.
    step()
    prefilling = [s for s in engine._scheduler.running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
    assert prefilling and prefilling[0].seq_id == ids[0] and prefilling[0].block_table
    abort(ids[0], "prefill")

    # Mid-decode: running with some generated tokens.
    for _ in range(100):
        step()
        decoding = [s for s in engine._scheduler.running if len(s.completion_token_ids) >= 2]
        if decoding:
            break
    assert decoding
    victim = decoding[0].seq_id
    abort(victim, "decode")
    assert 0 < len(outputs[victim]) < 10

    cached_seen: dict[int, int] = {}
    while engine.has_unfinished():
        step()
        for s in engine._scheduler.running:
            cached_seen[s.seq_id] = max(cached_seen.get(s.seq_id, 0), s.num_cached_tokens)
    # The blocks the aborted request had computed stayed in the prefix cache, and were valid KV.
    assert cached_seen.get(ids[4]) == 8  # two full blocks of the shared prefix were written before the abort

    engine.abort(ids[0])  # aborting twice, or an unknown id, is a no-op
    engine.abort(10**9)
    assert_drained(engine)

    survivors = [i for i in ids if i not in aborted]
    assert len(survivors) == 3
    reference = make_engine(tiny_llama, enable_prefix_caching=False)
    got, want = [], []
    for request_id in survivors:
        completion = as_completion(outputs[request_id])
        assert completion.finish_reason == "length" and len(completion.token_ids) == 10
        got.append(completion)
        want.append(reference.generate([prompts[ids.index(request_id)]], params)[0])
    check_near_ties("abort survivors", got, want, exact=False)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recompute-all", "prefix-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_preemption_by_recompute_is_lossless(
    tiny_llama: Path, corpus_ids: list[int], dtype: torch.dtype, prefix_caching: bool
) -> None:
    prompts = [corpus_ids[60 * i : 60 * i + 20] for i in range(4)]
    params = greedy(24, logprobs=TOP)
    # 20 + 24 tokens = 11 blocks of 4 per sequence: 24 blocks hold two of them, not four.
    small = make_engine(tiny_llama, dtype, num_blocks=24, max_model_len=64, enable_prefix_caching=prefix_caching)
    roomy = make_engine(tiny_llama, dtype, num_blocks=256, max_model_len=64, enable_prefix_caching=False)

    recomputed_with_output: set[int] = set()

    def watch(_: int) -> None:
        for seq in small._scheduler.waiting:
            if seq.completion_token_ids:  # preempted after generating: recomputes prompt + output
                recomputed_with_output.add(seq.seq_id)
        small._block_manager.check_invariants(small._scheduler.running)

    outputs, order = run_steps(small, {0: [(p, params) for p in prompts]}, watch)
    got = [as_completion(outputs[i]) for i in order]
    want = roomy.generate(prompts, params)
    assert small._scheduler.num_preemptions > 0
    assert recomputed_with_output
    assert roomy._scheduler.num_preemptions == 0
    for completion in got:
        assert completion.finish_reason == "length" and len(completion.token_ids) == 24
    check_near_ties(f"preemption {dtype} cache={prefix_caching}", got, want, exact=dtype == torch.float32)
    assert_drained(small)


# ---------------------------------------------------------------------------------------------
# Sampling and stop conditions
# ---------------------------------------------------------------------------------------------


def test_seeded_sampling_reproduces_across_engines(tiny_llama: Path) -> None:
    prompts = text_prompts(tiny_llama)[:3]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=seed, max_tokens=20, ignore_eos=True, logprobs=2)
        for seed in (1, 2, 3)
    ]
    first = make_engine(tiny_llama).generate(prompts, params)
    other = make_engine(tiny_llama)
    second = other.generate(prompts, params)
    again = other.generate(prompts, params)  # a fresh generator per request, not one per engine
    for a, b, c in zip(first, second, again, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.text == b.text == c.text
        assert [x["logprob"] for x in a.logprobs] == [x["logprob"] for x in b.logprobs]
        assert len(a.token_ids) == 20 and a.finish_reason == "length"

    # The seed matters, and sampling is not greedy.
    base = dict(temperature=0.9, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True)
    (other_seed,) = other.generate([prompts[0]], SamplingParams(**base, seed=4))
    (argmax,) = other.generate([prompts[0]], greedy(20))
    assert other_seed.token_ids != first[0].token_ids
    assert argmax.token_ids != first[0].token_ids
    assert_drained(other)

    # top_k=1 leaves one candidate: sampling is then greedy. In float32: bf16 logits tie exactly
    # now and then, and argmax and a descending sort may break a tie differently.
    fp32 = make_engine(tiny_llama, torch.float32)
    (top1,) = fp32.generate([prompts[0]], SamplingParams(temperature=1.0, top_k=1, seed=0, max_tokens=20))
    (argmax,) = fp32.generate([prompts[0]], greedy(20))
    assert top1.token_ids == argmax.token_ids


def test_stop_strings_stop_tokens_and_length(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    tokenizer = engine.tokenizer
    prompt = text_prompts(tiny_llama)[0]
    (full,) = engine.generate([prompt], greedy(24))
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    assert full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)

    # A 4-character stop string from the second half of the text, at its first occurrence.
    text = full.text
    start = next(
        i
        for i in range(len(text) // 3, len(text) - 4)
        if "\ufffd" not in text[i : i + 4] and text.find(text[i : i + 4]) == i
    )
    stop = text[start : start + 4]
    (cut,) = engine.generate([prompt], greedy(24, stop=["never in this text \x00", stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == text[:start]  # streamed pieces, stop string excluded
    n = len(cut.token_ids)
    assert n < 24 and cut.token_ids == full.token_ids[:n]
    # It stopped on the token that completed the stop string.
    assert stop in tokenizer.decode(cut.token_ids) and stop not in tokenizer.decode(cut.token_ids[:-1])

    # Stop strings that never match: the text held back in case they would is released at the end.
    (unmatched,) = engine.generate([prompt], greedy(24, stop=["\x00never", "zzzzzz"]))
    assert unmatched.text == text and unmatched.finish_reason == "length"

    # A stop token: the first time greedy produces it.
    token = full.token_ids[3]
    first = full.token_ids.index(token)
    (stopped,) = engine.generate([prompt], greedy(24, stop_token_ids=[token]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.text == tokenizer.decode(stopped.token_ids, skip_special_tokens=True)

    # max_tokens ends with "length", whatever the count.
    for n in (1, 5):
        (short,) = engine.generate([prompt], greedy(n))
        assert short.finish_reason == "length" and short.token_ids == full.token_ids[:n]
    assert_drained(engine)


def rewrite_eos(checkpoint: Path, eos: list[int]) -> None:
    path = checkpoint / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = eos
    path.write_text(json.dumps(config))


def test_generation_config_eos_ends_with_stop(tiny_llama_copy: Path) -> None:
    """A second EOS id in generation_config.json (as Llama 3 has): generating it ends the request."""
    prompt = text_prompts(tiny_llama_copy)[0]
    (full,) = make_engine(tiny_llama_copy).generate([prompt], greedy(24))
    token = full.token_ids[3]
    assert token != tiny_models.EOS_TOKEN_ID
    first = full.token_ids.index(token)
    rewrite_eos(tiny_llama_copy, [tiny_models.EOS_TOKEN_ID, token])

    engine = make_engine(tiny_llama_copy)
    assert engine.eos_ids == {tiny_models.EOS_TOKEN_ID, token}
    (ended,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))
    assert ended.finish_reason == "stop"
    assert ended.token_ids == full.token_ids[: first + 1]  # the EOS token is returned as a token ...
    assert ended.text == engine.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)  # ... not as text
    (ignored,) = engine.generate([prompt], greedy(24))
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"
    assert_drained(engine)


def test_grammar_stop_tokens_are_the_engines_eos_ids(tiny_llama_copy: Path) -> None:
    rewrite_eos(tiny_llama_copy, [tiny_models.EOS_TOKEN_ID, 100])
    engine = make_engine(tiny_llama_copy)
    matcher = engine.grammars.matcher(GrammarSpec("json_object"))
    assert set(matcher.stop_token_ids) == engine.eos_ids == {tiny_models.EOS_TOKEN_ID, 100}


# ---------------------------------------------------------------------------------------------
# Structured output
# ---------------------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        # Strings bounded by `pattern`, not maxLength (xgrammar#800).
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, num_blocks=512, max_model_len=512)
    prompts = text_prompts(tiny_llama)[:3]
    # The engine's grammars allow free whitespace between JSON tokens (vLLM's default), and the
    # random model loves whitespace: penalties keep it from spending the whole budget on it.
    params = SamplingParams(temperature=0.0, max_tokens=256, frequency_penalty=2.0, presence_penalty=2.0)
    out = engine.generate(prompts, params, GrammarSpec("json_schema", json.dumps(SCHEMA)))
    for completion in out:
        print(f"json_schema: {len(completion.token_ids)} tokens")
        assert completion.finish_reason == "stop", (len(completion.token_ids), completion.text)
        assert completion.token_ids[-1] in engine.eos_ids  # the grammar ended on EOS
        value = json.loads(completion.text)
        assert set(value) == {"name", "age", "kind", "ok"}
        assert re.fullmatch(r"[a-z]{1,8}", value["name"])
        assert type(value["age"]) is int and 0 <= value["age"] <= 120
        assert value["kind"] in ("cat", "dog")
        assert type(value["ok"]) is bool
    assert_drained(engine)


def test_regex_output_full_matches(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    params = [greedy(40), SamplingParams(temperature=1.0, seed=7, max_tokens=40)]
    for p in params:
        for completion in engine.generate(text_prompts(tiny_llama), p, GrammarSpec("regex", pattern)):
            assert completion.finish_reason == "stop"
            assert re.fullmatch(pattern, completion.text), completion.text
    assert_drained(engine)


# ---------------------------------------------------------------------------------------------
# Bad input to add_request
# ---------------------------------------------------------------------------------------------

BAD_PARAMS = [
    {"temperature": -1.0},
    {"temperature": float("nan")},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_k": -2},
    {"min_p": 1.5},
    {"repetition_penalty": 0.0},
    {"frequency_penalty": 3.0},
    {"presence_penalty": -2.5},
    {"max_tokens": 0},
    {"logprobs": 21},
    {"seed": 1.5},
    {"stop": [""]},
    {"stop_token_ids": [-1]},
]
BAD_GRAMMARS = [
    (GrammarSpec("json_schema", "{"), "not valid JSON"),
    (GrammarSpec("json_schema", '{"type": "nope"}'), "invalid json_schema"),
    (GrammarSpec("regex", "(ab"), "invalid regex"),
    (GrammarSpec("grammar", "root ::= undefined_rule"), "invalid grammar"),
]


def test_add_request_rejects_bad_input(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="exceeds the context length 64"):
        engine.add_request(list(range(60)), greedy(5))
    for bad in BAD_PARAMS:
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field.split("_ids")[0]):
            engine.add_request([5, 6, 7], SamplingParams(**bad))
    for spec, match in BAD_GRAMMARS:
        with pytest.raises(ValueError, match=match):
            engine.add_request([5, 6, 7], greedy(4), spec)
    with pytest.raises(ValueError, match="unknown grammar kind"):
        GrammarSpec("yaml")
    # Nothing was queued by the rejected requests.
    assert engine.requests == {} and not engine.has_unfinished()

    # The boundary itself is fine: prompt + max_tokens == max_model_len.
    (edge,) = engine.generate([list(range(3, 62))], greedy(5))
    assert len(edge.token_ids) == 5 and edge.finish_reason == "length"
    assert_drained(engine)


@pytest.mark.parametrize("token", [-1, tiny_models.VOCAB_SIZE])
def test_add_request_rejects_token_ids_outside_the_vocabulary(tiny_llama: Path, token: int) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError):
        engine.add_request([5, token], greedy(2))
