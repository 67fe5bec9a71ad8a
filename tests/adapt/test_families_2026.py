"""This year's families that reuse the engine's mechanisms (issue #38's quick ones), each on a tiny
seeded checkpoint: the source in exact and fast numerics against transformers, then the NVFP4
artifact its shipped recipe makes, proven by the W4A4 rule whole-model and layer by layer."""

import json

import pytest
import torch

from onboard.adapt.measure import measure_parity
from onboard.models import inspect_checkpoint
from onboard.recipes import Calibration, Quantize, recipe_for

CALIB = Calibration(num_samples=2, max_seq_length=64)
# fixture -> (architecture, engine model, recipe)
FAMILIES = {
    "tiny_minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Model", "minimax_m2.yaml"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_source_is_transformers_bit_for_bit(family: str, request: pytest.FixtureRequest) -> None:
    arch, engine_model, _ = FAMILIES[family]
    source = request.getfixturevalue(family)
    assert json.loads((source / "config.json").read_text())["architectures"] == [arch]
    result = measure_parity(inspect_checkpoint(source), torch.bfloat16, num_prompts=2)
    assert result["engine_model"] == engine_model and result["max_abs_logit_diff"] == 0.0
    assert result["greedy_match_rate"] == 1.0 and result["logprobs_close"]
    assert result["fast"]["logprobs_close"], result["fast"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_recipes_nvfp4_artifact_is_proven(family: str, request: pytest.FixtureRequest, quantized_run) -> None:
    arch, engine_model, recipe_name = FAMILIES[family]
    recipe, path = recipe_for([arch])
    assert path is not None and path.name == recipe_name
    source = request.getfixturevalue(family)
    settings = Quantize.model_validate({**recipe.quantize.model_dump(), "calibration": CALIB.model_dump()})
    artifact = quantized_run(source, settings) / "artifact"
    ignore = json.loads((artifact / "config.json").read_text())["quantization_config"]["ignore"]
    assert "lm_head" in ignore and any(name.endswith(".gate") for name in ignore)  # the routers stay BF16
    result = measure_parity(
        inspect_checkpoint(artifact), torch.bfloat16, num_prompts=2, source=inspect_checkpoint(source)
    )
    assert result["engine_model"] == engine_model and result["rule"] == "layerwise_distribution"
    assert result["max_abs_logit_diff"] == 0.0  # exact numerics: transformers' own products
    exact = result["distribution"]
    assert exact["kl_ratio"] == 0.0 and exact["damage_diff"] == 0.0 and exact["kl_source_transformers"] > 0
    assert result["layerwise"]["passed"] and result["layerwise"]["max_linear_ratio"] == 0.0
