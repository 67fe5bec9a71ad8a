"""`onboard adapt` on the MLA / DSA / DeepSeek-MoE families, whole-model and layer by layer."""

from pathlib import Path

import pytest
import tiny_models
import torch

from onboard.adapt.layerwise import measure_layerwise
from onboard.adapt.measure import measure_parity, parity_prompts
from onboard.engine.models.deepseek_v3 import DeepseekV3Model
from onboard.models import inspect_checkpoint, load_tokenizer

MLA_FIXTURES = [f"tiny_{arch}" for arch in tiny_models.MLA_ARCHS]
PROMPTS = 4


@pytest.fixture(scope="module")
def whole_parity(request: pytest.FixtureRequest):
    """`measure_parity` on the first PROMPTS parity prompts, once per (fixture, dtype) in this module."""
    done: dict[tuple[str, torch.dtype], dict] = {}

    def measured(arch: str, dtype: torch.dtype) -> dict:
        if (arch, dtype) not in done:
            done[arch, dtype] = measure_parity(
                inspect_checkpoint(request.getfixturevalue(arch)), dtype, num_prompts=PROMPTS
            )
        return done[arch, dtype]

    return measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", MLA_FIXTURES)
def test_whole_model_parity(arch: str, dtype: torch.dtype, whole_parity) -> None:
    result = whole_parity(arch, dtype)
    assert result["engine_model"] == "DeepseekV3Model" and result["numerics"] == "exact"
    assert result["max_abs_logit_diff"] <= 1e-4  # exact numerics: the prefill is transformers' own
    assert result["top1_agreement"] == 1.0
    assert result["greedy_match_rate"] == 1.0 and result["logprobs_close"]
    assert result["kv_bytes_per_token"] > 0
    if arch != "tiny_deepseek_v3":
        sets = result["index_sets"]
        assert sets["positions"] > 0 and sets["equal_rate"] == 1.0
    else:
        assert "index_sets" not in result
    # fast numerics against the same reference continuations: the weight-absorbed decode in fp32,
    # the expanded one through fast kernels in bf16; every divergence a near-tie
    fast = result["fast"]
    assert fast["logprobs_close"], fast
    if dtype == torch.float32:
        assert fast["greedy_match_rate"] == 1.0 and fast["top1_agreement"] >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plain_families_report_the_fast_numerics_too(tiny_llama: Path, dtype: torch.dtype) -> None:
    result = measure_parity(inspect_checkpoint(tiny_llama), dtype, num_prompts=3)
    assert "index_sets" not in result
    assert result["greedy_match_rate"] == 1.0 and result["max_abs_logit_diff"] == 0.0  # exact: bitwise
    fast = result["fast"]
    assert set(fast) >= {"max_abs_logprob_diff", "top1_agreement", "greedy_match_rate", "logprobs_close"}
    assert 0 < fast["num_decode_positions"] <= 3 * 64  # every generated token
    assert fast["logprobs_close"] and fast["top1_agreement"] >= 0.99
    assert fast["max_abs_logprob_diff"] <= (1e-4 if dtype == torch.float32 else 0.1)
    # The measure is decode-shaped on both sides: exact numerics, whose greedy tokens are
    # transformers' own, is its floor, every top token the same.  (Its log probabilities are not
    # bitwise here: this tiny model's lm_head is below oneDNN's size, and PyTorch's own kernel
    # rounds the engine's one row and generate's two differently; the demo model's are bitwise.)
    assert fast["exact_top1_agreement"] == 1.0
    assert fast["exact_max_abs_logprob_diff"] <= (1e-5 if dtype == torch.float32 else 0.1)


def _prompts(path: Path) -> list[list[int]]:
    return parity_prompts(load_tokenizer(inspect_checkpoint(path)), 3)


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        *(
            pytest.param(arch, dtype, id=f"{arch}-{name}")
            for arch in ["tiny_llama", "tiny_qwen3_moe", "tiny_qwen3_5", "tiny_qwen3_5_moe", *MLA_FIXTURES]
            for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
        ),
        # bf16 only: its fp32 whole-model parity is tests/engine/test_glm5_next.py's (a third of the cost)
        pytest.param("tiny_glm5_next", torch.bfloat16, id="tiny_glm5_next-bf16"),
    ],
)
def test_layerwise_parity_agrees_with_whole_model(arch: str, dtype: torch.dtype, request, whole_parity) -> None:
    """GLM-5.3-Flash's layers take and give hyper-connection streams and hand a selection on."""
    path = request.getfixturevalue(arch)
    layerwise = measure_layerwise(path, _prompts(path), dtype)
    config_layers = len(layerwise["layers"])
    if arch == "tiny_glm5_next":
        assert config_layers == len(tiny_models.GLM5_NEXT_TEXT["layer_types"])
        assert whole_parity(arch, dtype)["index_sets"]["equal_rate"] == 1.0  # the pooled indexer's picks
    else:
        assert config_layers == (tiny_models.DEEPSEEK_LAYERS if "deepseek" in arch or "glm" in arch else 2)
    assert layerwise["passed"] and layerwise["first_failing_layer"] is None
    whole = whole_parity(arch, dtype)  # PROMPTS prompts, the layerwise ones among them
    # Both proofs agree: whole-model logits match exactly where every layer does.
    assert whole["max_abs_logit_diff"] <= 1e-4 and layerwise["max_abs_diff"] <= 1e-4


def test_a_wrong_layer_is_caught_and_named(tiny_deepseek_v32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Break one engine layer (its o_proj output scaled by 1.05): layerwise names exactly that
    layer, and whole-model parity fails too."""
    original = DeepseekV3Model.make_layer

    def broken(self, config, weights, prefix, layer_idx):
        layer = original(self, config, weights, prefix, layer_idx)
        if layer_idx == 1:
            forward = layer.self_attn.o_proj.forward
            layer.self_attn.o_proj.forward = lambda x: forward(x) * 1.05
        return layer

    monkeypatch.setattr(DeepseekV3Model, "make_layer", broken)
    layerwise = measure_layerwise(tiny_deepseek_v32, _prompts(tiny_deepseek_v32), torch.float32)
    assert not layerwise["passed"]
    assert layerwise["first_failing_layer"] == "model.layers.1"
    assert [e["passed"] for e in layerwise["layers"]] == [True, False, True]
    whole = measure_parity(inspect_checkpoint(tiny_deepseek_v32), torch.float32, num_prompts=2)
    assert whole["max_abs_logit_diff"] > 1e-2
