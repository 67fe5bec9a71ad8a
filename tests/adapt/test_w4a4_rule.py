"""The parity rule for artifacts that quantize activations to 4 bits (`layerwise_distribution`).

On a tiny NVFP4 W4A4 llama artifact: exact numerics pass it with nothing to see; a layer broken on
purpose (o_proj x 1.05) fails and is named, down to the linear; a pure kernel difference (one
layer's linears computed in fp32) passes; a quantized MoE artifact runs layer by layer through
compressed-tensors' own lifecycle; and the gate applies the rule's checks instead of the token
checks.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from onboard.adapt.layerwise import MAX_LINEAR_RATIO, measure_layerwise
from onboard.adapt.measure import measure_parity, parity_prompts
from onboard.engine.linear import EngineLinear
from onboard.engine.models.llama import LlamaModel
from onboard.errors import OnboardError
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.recipes import Calibration, Gate, Quantize, recipe_for

CALIB = Calibration(num_samples=2, max_seq_length=64)
BROKEN = 1  # the decoder layer broken (or recomputed) on purpose


@pytest.fixture(scope="module")
def w4a4(quantized_run, tiny_llama: Path) -> Path:
    return quantized_run(tiny_llama, Quantize(scheme="nvfp4", calibration=CALIB)) / "artifact"


def _patch_layer(monkeypatch: pytest.MonkeyPatch, change) -> None:
    original = LlamaModel.make_layer

    def make_layer(self, config, weights, prefix, layer_idx):
        layer = original(self, config, weights, prefix, layer_idx)
        if layer_idx == BROKEN:
            change(layer)
        return layer

    monkeypatch.setattr(LlamaModel, "make_layer", make_layer)


def _scaled_o_proj(layer) -> None:
    forward = layer.self_attn.o_proj.forward
    layer.self_attn.o_proj.forward = lambda x: forward(x) * 1.05


def _linears_in_fp32(layer) -> None:
    """The same quantized inputs and weights, multiplied and summed in fp32, rounded once."""
    for module in layer.modules():
        if isinstance(module, EngineLinear):

            def forward(x, m=module):
                x = m.act_quant(x) if m.act_quant is not None else x
                return F.linear(x.float(), m.weight.float()).to(x.dtype)

            module.forward = forward


def _prompts(path: Path) -> list[list[int]]:
    return parity_prompts(load_tokenizer(inspect_checkpoint(path)), 2)


def test_exact_numerics_pass_with_nothing_to_see(w4a4: Path, tiny_llama: Path) -> None:
    result = measure_parity(
        inspect_checkpoint(w4a4), torch.bfloat16, num_prompts=2, source=inspect_checkpoint(tiny_llama)
    )
    assert result["rule"] == "layerwise_distribution"
    assert result["max_abs_logit_diff"] == 0.0  # exact: transformers' own products
    exact = result["distribution"]
    assert exact["kl_transformers_engine"] == 0.0 and exact["kl_ratio"] == 0.0 and exact["damage_diff"] == 0.0
    assert exact["kl_source_transformers"] > 0  # the artifact is quantized: the source is elsewhere
    assert exact["kl_transformers_floor"] > 0  # a last-bit move of the inputs moves transformers too
    assert set(result["fast"]["distribution"]) == set(exact)
    layerwise = result["layerwise"]
    assert layerwise["passed"] and layerwise["max_floor_ratio"] == 0.0 and layerwise["max_linear_ratio"] == 0.0
    assert all(entry["floor_rms"] > 0 for entry in layerwise["layers"])  # every layer has a floor to measure by


def test_a_layer_broken_on_purpose_is_named(w4a4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_layer(monkeypatch, _scaled_o_proj)
    result = measure_layerwise(w4a4, _prompts(w4a4), torch.bfloat16)
    assert not result["passed"]
    assert result["first_failing_layer"] == f"model.layers.{BROKEN}"
    assert result["first_failing_module"] == f"model.layers.{BROKEN}.self_attn.o_proj"
    assert result["max_linear_ratio"] > MAX_LINEAR_RATIO
    assert [e["passed"] for e in result["layers"]] == [i != BROKEN for i in range(len(result["layers"]))]


def test_a_pure_kernel_difference_passes(w4a4: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_layer(monkeypatch, _linears_in_fp32)
    result = measure_parity(
        inspect_checkpoint(w4a4), torch.bfloat16, num_prompts=2, source=inspect_checkpoint(tiny_llama)
    )
    layerwise = result["layerwise"]
    assert layerwise["passed"], layerwise["layers"][BROKEN]
    gate = Gate()
    assert result["distribution"]["kl_ratio"] <= gate.max_parity_kl_ratio
    assert result["distribution"]["damage_diff"] <= gate.max_parity_damage_diff


def test_the_rule_needs_the_unquantized_source(w4a4: Path) -> None:
    with pytest.raises(OnboardError, match="quantizes activations to 4 bits"):
        measure_parity(inspect_checkpoint(w4a4), torch.bfloat16, num_prompts=1)


def test_a_quantized_moe_artifact_runs_layer_by_layer(quantized_run, tiny_qwen3_moe: Path) -> None:
    recipe, _ = recipe_for(["Qwen3MoeForCausalLM"])
    settings = Quantize.model_validate({**recipe.quantize.model_dump(), "calibration": CALIB.model_dump()})
    artifact = quantized_run(tiny_qwen3_moe, settings) / "artifact"
    result = measure_layerwise(artifact, _prompts(artifact), torch.bfloat16)
    assert result["passed"], result["layers"]
    assert result["max_linear_ratio"] == 0.0  # every expert linear on its own routed tokens: bitwise
