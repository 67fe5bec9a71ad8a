"""MLA, DSA and DeepSeek MoE in the engine (deepseek_v3, deepseek_v32, glm_moe_dsa) against transformers.

Teacher-forced logits are the expanded form transformers computes (equal in fp32 and bf16); decode
runs the weight-absorbed form, equal in fp32 up to float rounding and within near-ties in bf16.
"""

from pathlib import Path

import pytest
import tiny_models
import torch
import transformers
from hf_reference import TOP, hf_greedy

from onboard.adapt.dsa import reference_selections
from onboard.adapt.parity import compare_greedy
from onboard.engine import EngineConfig, LLMEngine, SamplingParams
from onboard.engine.layers.dsa import Selection

MLA_FIXTURES = [f"tiny_{arch}" for arch in tiny_models.MLA_ARCHS]
DSA_FIXTURES = [f"tiny_{arch}" for arch in tiny_models.DSA_ARCHS]


def make_engine(path: Path, dtype: torch.dtype, **overrides) -> LLMEngine:
    settings = {"block_size": 4, "num_blocks": 512, "max_model_len": 512, "enable_prefix_caching": False, **overrides}
    return LLMEngine(path, EngineConfig(**settings), dtype=dtype)


def prompts(n: int, lengths=(40, 57, 23, 70), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, tiny_models.VOCAB_SIZE, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)


def top_ids(completion) -> list[list[int]]:
    return [[t for t, _ in entry["top"]] for entry in completion.logprobs]


def load_hf(path: Path, dtype: torch.dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", MLA_FIXTURES)
def test_teacher_forced_logits_equal_transformers(arch: str, dtype: torch.dtype, request) -> None:
    path = request.getfixturevalue(arch)
    engine, model = make_engine(path, dtype), load_hf(path, dtype)
    for prompt in prompts(3):
        with torch.inference_mode():
            want = model(torch.tensor([prompt])).logits[0].float()
        got = engine.score(prompt)
        # Prefill is transformers' expanded MLA (and DSA mask) op for op: equal, not just close.
        assert torch.equal(got, want), (arch, (got - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", MLA_FIXTURES)
def test_greedy_decoding_matches_transformers(arch: str, dtype: torch.dtype, request) -> None:
    """Exact numerics: 24-token greedy continuations identical to transformers' in fp32 and bf16."""
    path = request.getfixturevalue(arch)
    engine, model = make_engine(path, dtype), load_hf(path, dtype)
    for prompt in prompts(3):
        (mine,) = engine.generate([prompt], greedy(24))
        theirs, their_top = hf_greedy(model, prompt, 24)
        verdict = compare_greedy(mine.token_ids, theirs, top_ids(mine), their_top)
        assert verdict.matched, (arch, verdict)


@pytest.mark.parametrize("arch", MLA_FIXTURES)
def test_absorbed_decode_equals_expanded_decode_in_fp32(arch: str, request) -> None:
    """Fast numerics (weight-absorbed decode) and exact (expanded) are the same function."""
    path = request.getfixturevalue(arch)
    absorbed = make_engine(path, torch.float32, numerics="fast")
    expanded = make_engine(path, torch.float32)
    calls = []
    original = absorbed._runner.model.layers[0].self_attn.w_uk
    assert original.shape == (tiny_models.NUM_ATTENTION_HEADS, tiny_models.QK_NOPE_HEAD_DIM, tiny_models.KV_LORA_RANK)
    absorbed._runner.backend.decode = _spy(absorbed._runner.backend.decode, calls)
    prompt = prompts(1, lengths=(50,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=20)
    (a,) = absorbed.generate([prompt], params)
    (b,) = expanded.generate([prompt], params)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert abs(x["logprob"] - y["logprob"]) < 1e-4
    assert calls and set(calls) == {"latent"}  # decode really attended over the latent rows


def _spy(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(kwargs.get("keys"))
        return fn(*args, **kwargs)

    return wrapped


def test_kv_layout_is_the_latent_not_expanded_kv(tiny_deepseek_v3: Path, tiny_glm_moe_dsa: Path) -> None:
    engine = make_engine(tiny_deepseek_v3, torch.bfloat16)
    (latent,) = engine.kv_layout.tensors
    assert latent.name == "latent" and latent.shape == (1, tiny_models.KV_LORA_RANK + tiny_models.QK_ROPE_HEAD_DIM)
    layers = tiny_models.DEEPSEEK_LAYERS
    assert engine.kv_layout.bytes_per_token() == layers * (tiny_models.KV_LORA_RANK + tiny_models.QK_ROPE_HEAD_DIM) * 2
    per_head = tiny_models.QK_NOPE_HEAD_DIM + tiny_models.QK_ROPE_HEAD_DIM + tiny_models.V_HEAD_DIM
    expanded = layers * tiny_models.NUM_ATTENTION_HEADS * per_head * 2
    assert engine.kv_layout.bytes_per_token() < expanded
    glm = make_engine(tiny_glm_moe_dsa, torch.bfloat16)
    index = next(t for t in glm.kv_layout.tensors if t.name == "index_k")
    assert index.layers == (0, 2) and index.shape == (tiny_models.INDEX_HEAD_DIM,)  # layer 1 shares layer 0's
    assert glm.stats()["kv_bytes_per_token"] == glm.kv_layout.bytes_per_token()


@pytest.mark.parametrize("arch", DSA_FIXTURES)
def test_dsa_index_sets_equal_transformers_at_every_position(arch: str, request) -> None:
    path = request.getfixturevalue(arch)
    engine, model = make_engine(path, torch.float32), load_hf(path, torch.float32)
    for prompt in prompts(2, lengths=(70, 45)):
        trace: dict[int, list[Selection]] = {}
        engine.score(prompt, trace=trace)
        want = reference_selections(model, prompt)
        assert sorted(trace) == sorted(want)
        for layer, (selection,) in trace.items():
            (got,) = selection.prefill
            assert got is not None and got.shape == want[layer].shape
            assert torch.equal(got, want[layer]), (arch, layer)
            counts = got.sum(-1)  # the top-k really restricts: at most index_topk keys per query
            assert int(counts.max()) == tiny_models.INDEX_TOPK and int(counts[-1]) == tiny_models.INDEX_TOPK


def _dense(engine: LLMEngine) -> LLMEngine:
    for layer in engine._runner.model.layers:
        layer.self_attn.indexer, layer.self_attn.shares_selection = None, False
    return engine


@pytest.mark.parametrize("arch", DSA_FIXTURES)
def test_dsa_equals_dense_mla_up_to_index_topk(arch: str, request) -> None:
    path = request.getfixturevalue(arch)
    sparse, dense = make_engine(path, torch.float32), _dense(make_engine(path, torch.float32))
    short, long = prompts(2, lengths=(tiny_models.INDEX_TOPK, 60))
    assert torch.equal(sparse.score(short), dense.score(short))
    # Past index_topk the selection drops keys: the two differ (so the check above could fail).
    assert not torch.allclose(sparse.score(long), dense.score(long))
    params = SamplingParams(temperature=0.0, max_tokens=tiny_models.INDEX_TOPK - len(short) // 2, ignore_eos=True)
    (a,) = sparse.generate([short[: len(short) // 2]], params)
    (b,) = dense.generate([short[: len(short) // 2]], params)
    assert a.token_ids == b.token_ids


def test_mtp_weights_are_skipped_with_a_notice(tiny_deepseek_v3: Path, tmp_path: Path, capsys) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(tiny_deepseek_v3, tmp_path / "with_mtp"))
    tensors = load_file(path / "model.safetensors")
    mtp = f"model.layers.{tiny_models.DEEPSEEK_LAYERS}"
    tensors[f"{mtp}.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    tensors[f"{mtp}.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    engine = make_engine(path, torch.float32)
    assert "skipping 2 multi-token-prediction tensors" in capsys.readouterr().err
    reference = make_engine(tiny_deepseek_v3, torch.float32)
    prompt = prompts(1)[0]
    assert torch.equal(engine.score(prompt), reference.score(prompt))


def _assert_drained(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine._block_manager.num_free_blocks == engine.config.num_blocks
    engine._block_manager.check_invariants([])


@pytest.mark.parametrize("arch", ["tiny_deepseek_v3", "tiny_glm_moe_dsa"])
def test_prefix_cache_chunked_prefill_and_preemption_give_the_cold_runs_tokens(arch: str, request) -> None:
    """fp32: prefix-cache hits, chunked prefill next to decodes, and preemption by recompute
    change neither the tokens nor leave blocks (latent or indexer) behind."""
    path = request.getfixturevalue(arch)
    shared = prompts(1, lengths=(32,), seed=7)[0]
    work = [shared + p for p in prompts(4, lengths=(9, 21, 5, 30), seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cold = make_engine(path, torch.float32)
    want = [cold.generate([p], params)[0].token_ids for p in work]

    warm = make_engine(path, torch.float32, enable_prefix_caching=True, max_num_batched_tokens=16)
    warm.generate([work[0]], params)  # leaves the shared prefix in the cache
    got = [c.token_ids for c in warm.generate(work, params)]
    assert warm._block_manager.hit_rate > 0
    assert got == want
    _assert_drained(warm)

    small = make_engine(path, torch.float32, num_blocks=40, max_model_len=96)
    got = [c.token_ids for c in small.generate(work, params)]
    assert small._scheduler.num_preemptions > 0
    assert got == want
    _assert_drained(small)


@pytest.mark.parametrize("arch", ["tiny_deepseek_v32", "tiny_glm_moe_dsa"])
def test_speculative_greedy_equals_plain_greedy(arch: str, request) -> None:
    from transformers import AutoConfig

    from onboard.speculator.draft import Eagle3Draft, draft_layer_config

    path = request.getfixturevalue(arch)
    plain = make_engine(path, torch.float32)
    spec = make_engine(path, torch.float32)
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(AutoConfig.from_pretrained(path)), spec.vocab_size, [0, 1])
    draft.set_vocab(torch.arange(spec.vocab_size))
    target = spec.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    spec.set_speculator(draft.eval(), 3)
    work = prompts(3, lengths=(30, 12, 44))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(work, params)]
    got = [c.token_ids for c in spec.generate(work, params)]
    assert got == want
    assert spec.speculator.stats.num_drafts > 0
    _assert_drained(spec)


@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("arch", DSA_FIXTURES)
def test_the_sdpa_backend_gives_the_cpu_backends_tokens(arch: str, numerics: str, request) -> None:
    """The device-generic backend (one padded call, DSA as a key mask, verification as prefill)
    computes the same function as the exact per-row one: fp32 tokens equal on a batch."""
    path = request.getfixturevalue(arch)
    work = prompts(3, lengths=(30, 12, 44))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cpu = make_engine(path, torch.float32, numerics=numerics)
    sdpa = make_engine(path, torch.float32, numerics=numerics, attention_backend="sdpa")
    assert sdpa._runner.backend.name == "sdpa" and not sdpa._runner.backend.rowwise_verification
    assert [c.token_ids for c in sdpa.generate(work, params)] == [c.token_ids for c in cpu.generate(work, params)]
