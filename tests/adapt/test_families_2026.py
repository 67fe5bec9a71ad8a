"""This year's families that reuse the engine's mechanisms (issue #38's quick ones), each on a tiny
seeded checkpoint: the source in exact and fast numerics against transformers, then the NVFP4
artifact its shipped recipe makes, proven by the W4A4 rule whole-model and layer by layer."""

import json

import pytest
import torch
import transformers
from state_family import check_preemption, check_rollback, drained, engine, greedy, greedy_reference, prompts

from onboard.adapt.measure import measure_parity
from onboard.models import inspect_checkpoint
from onboard.recipes import Calibration, Quantize, recipe_for

CALIB = Calibration(num_samples=2, max_seq_length=64)
# fixture -> (architecture, engine model, recipe)
FAMILIES = {
    "tiny_glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "DeepseekV3Model", "deepseek_v3.yaml"),
    "tiny_minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Model", "minimax_m2.yaml"),
    "tiny_gpt_oss": ("GptOssForCausalLM", "GptOssModel", "gpt_oss.yaml"),
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
    assert "lm_head" in ignore and any(name.endswith((".gate", ".router")) for name in ignore)  # routers: BF16
    result = measure_parity(
        inspect_checkpoint(artifact), torch.bfloat16, num_prompts=2, source=inspect_checkpoint(source)
    )
    assert result["engine_model"] == engine_model and result["rule"] == "layerwise_distribution"
    assert result["max_abs_logit_diff"] == 0.0  # exact numerics: transformers' own products
    exact = result["distribution"]
    assert exact["kl_ratio"] == 0.0 and exact["damage_diff"] == 0.0 and exact["kl_source_transformers"] > 0
    assert result["layerwise"]["passed"] and result["layerwise"]["max_linear_ratio"] == 0.0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_serves_it_as_transformers_generates(family: str, request: pytest.FixtureRequest) -> None:
    """Prompts longer than gpt-oss's window prefilled in 48-token chunks and decoded past it,
    preempted sequences recomputed, and rejected draft tokens rolled back: transformers' tokens."""
    source = request.getfixturevalue(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    reference = greedy_reference(hf)
    llm = engine(source, max_num_batched_tokens=48)
    assert [o.token_ids for o in llm.generate(prompts(), greedy())] == reference
    assert drained(llm)
    check_preemption(source, reference)
    check_rollback(source, 3)
