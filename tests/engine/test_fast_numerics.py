"""Fast numerics (`EngineConfig(numerics="fast")`, the `fast` attention backend) against exact.

Fast computes the same function with other roundings: its greedy tokens agree with exact's up to
near-ties (each side's token in the other's top-5 where they part), on every family, alone and
batched; fp32 keeps the decode logits within float rounding.  It is batch invariant, and
speculative decoding in it gives plain fast decoding's tokens exactly.  Without batch invariance
(`batch_invariant=False`: the one-row GEMV, one padded attention call) it still agrees with exact
up to near-ties."""

from pathlib import Path

import pytest
import tiny_models
import torch

from onboard.adapt.parity import compare_greedy
from onboard.engine import EngineConfig, LLMEngine, SamplingParams
from onboard.recipes import Calibration, Quantize
from onboard.speculator.draft import Eagle3Draft, draft_layer_config

FAMILIES = ["tiny_llama", "tiny_qwen3", "tiny_qwen3_moe", *(f"tiny_{arch}" for arch in tiny_models.MLA_ARCHS)]


def make_engine(path: Path, dtype: torch.dtype, numerics: str, **overrides) -> LLMEngine:
    settings = {"block_size": 4, "num_blocks": 512, "max_model_len": 512, "enable_prefix_caching": False}
    return LLMEngine(path, EngineConfig(**{**settings, **overrides}, numerics=numerics), dtype=dtype)


def prompts(n: int, lengths=(40, 9, 57, 23), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, tiny_models.VOCAB_SIZE, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)
    ]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def top_ids(completion) -> list[list[int]]:
    return [[t for t, _ in entry["top"]] for entry in completion.logprobs]


def test_fast_numerics_selects_the_fast_backend(tiny_llama: Path) -> None:
    assert make_engine(tiny_llama, torch.float32, "fast")._runner.backend.name == "fast"
    assert make_engine(tiny_llama, torch.float32, "exact")._runner.backend.name == "cpu"
    explicit = make_engine(tiny_llama, torch.float32, "fast", attention_backend="sdpa")
    assert explicit._runner.backend.name == "sdpa"  # an explicit backend wins


def test_fast_numerics_binds_measured_kernels_and_exact_none(tiny_llama: Path) -> None:
    from onboard.engine.linear import EngineLinear

    def linears(engine: LLMEngine) -> list[EngineLinear]:
        return [m for m in engine._runner.model.modules() if isinstance(m, EngineLinear)]

    variant = make_engine(tiny_llama, torch.bfloat16, "fast", batch_invariant=False)
    assert variant._runner.backend.name == "fast_batched"
    assert all(m.kernels is not None for m in linears(variant))
    assert {r["shape"] for r in variant._runner.kernel_report} == {
        f"cpu:bfloat16:{m.out_features}x{m.in_features}:nobias" for m in linears(variant)
    }
    exact = make_engine(tiny_llama, torch.bfloat16, "exact")
    assert all(m.kernels is None for m in linears(exact)) and exact._runner.kernel_report == []
    # exact runs q, k and v (gate and up) as transformers does: three products, not one fused
    names = {name.rsplit(".", 1)[-1] for name, m in exact._runner.model.named_modules() if isinstance(m, EngineLinear)}
    assert "qkv_proj" not in names and "gate_up_proj" not in names
    with pytest.raises(ValueError, match="exact numerics is always batch invariant"):
        EngineConfig(numerics="exact", batch_invariant=False)


CASES = [(arch, dtype) for arch in FAMILIES for dtype in (torch.float32, torch.bfloat16)]
# MLA's weight-absorbed decode in bf16 moves tiny random models' logits by up to ~0.6 nats where
# a routed expert flips, past their top-5 (each side's token outside the other's): fp32 only.
CASES = [
    (arch, dtype)
    for arch, dtype in CASES
    if dtype == torch.float32 or arch.removeprefix("tiny_") not in tiny_models.MLA_ARCHS
]


# Without batch invariance (the one-row GEMV, one padded attention call) on the GQA families.
CASES = [(arch, dtype, True) for arch, dtype in CASES] + [
    (arch, dtype, False) for arch, dtype in CASES if arch.removeprefix("tiny_") not in tiny_models.MLA_ARCHS
]


@pytest.mark.parametrize(("arch", "dtype", "batch_invariant"), CASES)
def test_fast_agrees_with_exact_up_to_near_ties_alone_and_batched(
    arch: str, dtype: torch.dtype, batch_invariant: bool, request
) -> None:
    path = request.getfixturevalue(arch)
    exact = make_engine(path, dtype, "exact")
    fast = make_engine(path, dtype, "fast", batch_invariant=batch_invariant)
    work = prompts(4)
    want = exact.generate(work, greedy())
    for batch in ([work[0]], [work[1]], work):
        got = fast.generate(batch, greedy())
        for mine, ref in zip(got, [want[work.index(p)] for p in batch], strict=True):
            verdict = compare_greedy(mine.token_ids, ref.token_ids, top_ids(mine), top_ids(ref))
            assert verdict.near_tie, f"{arch}: fast parts from exact at token {verdict.first_divergence}"
            if dtype == torch.float32:
                agree = verdict.first_divergence if verdict.first_divergence is not None else len(ref.token_ids)
                deltas = [abs(a["logprob"] - b["logprob"]) for a, b in zip(mine.logprobs, ref.logprobs, strict=True)][
                    :agree
                ]
                assert max(deltas) < 1e-4
    # Teacher-forced scoring (a prefill) through fast's fused products: the same function.
    scored = (fast.score(work[2]) - exact.score(work[2])).abs().max()
    assert scored <= (1e-4 if dtype == torch.float32 else 0.25), scored


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3_moe", *(f"tiny_{arch}" for arch in tiny_models.MLA_ARCHS)])
def test_fast_numerics_is_batch_invariant(arch: str, request) -> None:
    """bf16, where a changed summation order shows: a request's tokens alone equal its tokens
    batched with longer and shorter ones, and among sampled requests."""
    fast = make_engine(request.getfixturevalue(arch), torch.bfloat16, "fast")
    work = prompts(6, lengths=(40, 9, 57, 23, 120, 3))
    alone = [fast.generate([p], greedy(32))[0].token_ids for p in work]
    batched = [c.token_ids for c in fast.generate(work, greedy(32))]
    sampled = SamplingParams(temperature=0.9, max_tokens=32, seed=3)
    mixed = fast.generate([work[4], work[0], work[5], work[1]], [sampled, greedy(32), sampled, greedy(32)])
    assert batched == alone
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[0], alone[1]]


def test_a_w4a4_artifact_is_batch_invariant_in_fast_numerics(quantized_run, tiny_llama: Path) -> None:
    """Every linear that feeds a quantizer runs tiled (where a tile size is invariant here): a
    request's tokens alone equal its tokens batched, with the prefix cache warm (fewer rows in its
    prefill), and among sampled requests."""
    artifact = quantized_run(tiny_llama, Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2))) / "artifact"
    fast = make_engine(artifact, torch.bfloat16, "fast", enable_prefix_caching=True)
    for row in fast.kernel_report:
        if row["feeds_quantizer"] and any(t["invariant"] for t in row["tiles"]):
            assert (row["one_row"], row["rows"]) == ("tiled", "tiled"), row["shape"]
    work = prompts(6, lengths=(40, 9, 57, 23, 120, 3))
    alone = [fast.generate([p], greedy(32))[0].token_ids for p in work]
    batched = [c.token_ids for c in fast.generate(work, greedy(32))]
    again = [c.token_ids for c in fast.generate(work[::-1], greedy(32))][::-1]
    assert fast.stats()["prefix_cache_hits"] > 0
    sampled = SamplingParams(temperature=0.9, max_tokens=32, seed=3)
    mixed = fast.generate([work[4], work[0], work[5], work[1]], [sampled, greedy(32), sampled, greedy(32)])
    assert batched == alone and again == alone
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[0], alone[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_decoding_in_fast_numerics_gives_plain_fast_tokens(tiny_llama: Path, dtype: torch.dtype) -> None:
    from transformers import AutoConfig

    engine = make_engine(tiny_llama, dtype, "fast")
    work = prompts(3)
    plain = [c.token_ids for c in engine.generate(work, greedy(30))]
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(AutoConfig.from_pretrained(tiny_llama)), engine.vocab_size, [0, 1])
    draft.set_vocab(torch.arange(engine.vocab_size))
    target = engine.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    engine.set_speculator(draft.eval(), 3)
    assert engine._runner.backend.rowwise_verification  # proposals attend as decode rows
    for batch in ([work[0]], work):
        spec = [c.token_ids for c in engine.generate(batch, greedy(30))]
        assert spec == [plain[work.index(p)] for p in batch]
    assert engine.speculator.stats.num_drafts > 0
