"""`onboard run`: every stage in order on a tiny model, the verdict as the exit code, resumed runs."""

import json
import math
from pathlib import Path

import pytest
from build_once import copy_of

from onboard.paths import RECIPES_DIR
from onboard.pipeline import DEMO_PROFILES, DEMO_RECIPE, STAGES, profile_overrides, run_pipeline, stage_context
from onboard.recipes import load_recipe, with_overrides

TINY = {
    "quantize.scheme": "nvfp4a16",
    "quantize.calibration.num_samples": 2,
    "quantize.calibration.max_seq_length": 64,
    "eval.max_tokens": 256,
    "eval.window": 64,
    "speculator.num_prompts": 4,
    "speculator.max_new_tokens": 12,
    "speculator.max_prompt_tokens": 48,
    "speculator.responses_per_prompt": 1,
    "speculator.stdlib_files": 0,
    "speculator.draft_vocab_size": 96,
    "speculator.epochs": 1,
    "speculator.max_seq_len": 64,
    "speculator.eval_prompts": 2,
    "speculator.eval_max_tokens": 8,
    "adapt.num_prompts": 2,
    "smoke.num_prompts": 4,
    "smoke.max_tokens": 24,
    "smoke.invariance_prompts": 2,
    "smoke.invariance_max_tokens": 8,
}


def overrides(**extra: object) -> dict[str, tuple[str, object]]:
    return {key: (key, value) for key, value in {**TINY, **extra}.items()}


@pytest.fixture(scope="module")
def quantized(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`onboard run --stages quantize` with TINY, once: the runs below take copies and resume it."""
    out = tmp_path_factory.mktemp("pipeline") / "run"
    assert run_pipeline(stage_context(tiny_llama, None, overrides()), out, ["quantize"]) == 0
    return out


def test_every_stage_then_the_verdict_as_exit_code(tiny_llama: Path, quantized: Path, tmp_path: Path, capsys) -> None:
    out = copy_of(quantized, tmp_path / "run")
    code = run_pipeline(stage_context(tiny_llama, None, overrides()), out, list(STAGES))
    gate = json.loads((out / "gate.json").read_text())
    assert gate["complete"] and code == (0 if gate["passed"] else 1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s for s in manifest["stages"] if manifest["stages"][s]["status"] == "done"] == [
        "quantize",
        "eval",
        "speculator",
        "adapt",
        "smoke",
    ]
    assert json.loads((out / "adapt" / "parity.json").read_text())["num_prompts"] == 2  # the recipe's
    report = (out / "report.html").read_text()
    assert "PASS" in report if gate["passed"] else "FAIL" in report
    # A threshold no run can meet turns the verdict, and the exit code, to a failure; every stage
    # is resumed from the manifest rather than redone.
    capsys.readouterr()
    code = run_pipeline(stage_context(tiny_llama, None, overrides(**{"gate.max_mean_kld": 0.0})), out, list(STAGES))
    assert code == 1 and not json.loads((out / "gate.json").read_text())["passed"]
    assert capsys.readouterr().err.count("cached, inputs unchanged") == 5


def test_a_run_without_the_stages_the_gate_needs_is_incomplete(
    tiny_llama: Path, quantized: Path, tmp_path: Path
) -> None:
    out = copy_of(quantized, tmp_path / "run")
    code = run_pipeline(stage_context(tiny_llama, None, overrides()), out, ["quantize", "report", "gate"])
    gate = json.loads((out / "gate.json").read_text())
    assert code == 2 and gate["missing"] == ["eval", "speculator", "adapt", "smoke"]
    assert "INCOMPLETE" in (out / "report.html").read_text()


@pytest.mark.parametrize("profile", sorted(DEMO_PROFILES))
def test_demo_profiles_are_valid_recipe_overrides(profile: str) -> None:
    recipe = with_overrides(load_recipe(RECIPES_DIR / DEMO_RECIPE), profile_overrides(profile))
    assert recipe.quantize.formats, "the demo replays the pinned SmolLM2 selection"
    for key, value in DEMO_PROFILES[profile].items():
        node = recipe.model_dump()
        for part in key.split("."):
            node = node[part]
        assert node == value, key


@pytest.mark.slow
def test_every_stage_on_a_dsa_model(tiny_deepseek_v32: Path, tmp_path: Path) -> None:
    """MLA + DSA + DeepSeek MoE through quantize, eval, speculator, adapt, smoke, report and gate."""
    out = tmp_path / "run"
    code = run_pipeline(stage_context(tiny_deepseek_v32, None, overrides()), out, list(STAGES))
    gate = json.loads((out / "gate.json").read_text())
    assert gate["complete"] and code == (0 if gate["passed"] else 1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(manifest["stages"][s]["status"] == "done" for s in ("quantize", "eval", "speculator", "adapt", "smoke"))
    parity = json.loads((out / "adapt" / "parity.json").read_text())
    assert parity["engine_model"] == "DeepseekV3Model" and parity["index_sets"]["equal_rate"] > 0.9
    assert (out / "artifact" / "speculator" / "config.json").is_file()
    checks = {c["name"]: c for c in gate["checks"]}
    assert checks["parity_top1_agreement"]["passed"] and checks["batch_invariant"]["passed"]


def test_skip_adapt_runs_a_family_the_engine_lacks_through_transformers(tmp_path: Path) -> None:
    """A Gemma 3 text model: quantized, evaluated and smoked through transformers; adapt and the
    speculator recorded as skipped with why, and the verdict incomplete (no adaptation proof)."""
    import tiny_models

    checkpoint = tiny_models.build_gemma3_text(tmp_path / "gemma3")
    out = tmp_path / "run"
    ctx = stage_context(checkpoint, None, overrides(), skip_adapt=True)
    assert run_pipeline(ctx, out, list(STAGES)) == 2
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    statuses = {name: stages[name]["status"] for name in stages}
    assert statuses == {
        "quantize": "done",
        "eval": "done",
        "speculator": "skipped",
        "adapt": "skipped",
        "smoke": "done",
    }
    assert "sandwich norms" in stages["adapt"]["reason"]
    smoke = json.loads((out / "smoke" / "smoke.json").read_text())
    assert smoke["generated_by"] == "transformers" and smoke["batch_invariant"] is None
    # the raw model's entropy at each step, both sides: positive and at most that of a uniform draw
    assert smoke["num_prompts"] == 4 and set(smoke["by_mode"]) == {"greedy", "sampled"}
    assert all(0 < smoke[key] <= math.log(tiny_models.VOCAB_SIZE) for key in ("mean_entropy", "reference_mean_entropy"))
    gate = json.loads((out / "gate.json").read_text())
    assert gate["missing"] == ["speculator", "adapt"] and set(gate["skipped"]) == {"speculator", "adapt"}
    assert next(c for c in gate["checks"] if c["name"] == "batch_invariant")["note"].startswith("not measured")
    report = (out / "report.html").read_text()
    assert "INCOMPLETE" in report and "adapt skipped: --skip-adapt: the adaptation proof is missing" in report


@pytest.mark.slow
def test_every_stage_on_a_qwen3_5_moe_release(tiny_qwen3_5_moe: Path, tmp_path: Path) -> None:
    """The VLM release (Gated DeltaNet over the state pool, gated attention, a sigmoid-gated shared
    expert, a vision tower, an MTP module) through every stage: its text model quantized, served and
    proven; the vision tower and MTP module kept, and the gate's checks of them passing."""
    out = tmp_path / "run"
    code = run_pipeline(stage_context(tiny_qwen3_5_moe, None, overrides()), out, list(STAGES))
    gate = json.loads((out / "gate.json").read_text())
    assert gate["complete"] and code == (0 if gate["passed"] else 1)
    parity = json.loads((out / "adapt" / "parity.json").read_text())
    assert parity["engine_model"] == "Qwen3_5MoeModel" and parity["max_abs_logit_diff"] == 0.0
    checks = {c["name"]: c for c in gate["checks"]}
    for name in ("vision_kept", "mtp_kept", "parity_top1_agreement", "fast_parity", "batch_invariant"):
        assert checks[name]["passed"], name
    selection = json.loads((out / "quantize" / "selection.json").read_text())
    assert selection["vision"]["tensors"] > 4 and "preprocessor_config.json" in selection["vision"]["processor_files"]


@pytest.mark.slow
def test_every_stage_on_a_glm5_next_release(tiny_glm5_next: Path, tmp_path: Path) -> None:
    """GLM-5.3-Flash's VLM release (KDA over the state pool, NoPE MLA with a pooled-key DSA indexer,
    hyper-connections, clamped experts, an MTP layer inside the language model) through every stage."""
    out = tmp_path / "run"
    code = run_pipeline(stage_context(tiny_glm5_next, None, overrides()), out, list(STAGES))
    gate = json.loads((out / "gate.json").read_text())
    assert gate["complete"] and code == (0 if gate["passed"] else 1)
    parity = json.loads((out / "adapt" / "parity.json").read_text())
    assert parity["engine_model"] == "Glm5NextModel" and parity["max_abs_logit_diff"] == 0.0
    assert parity["index_sets"]["equal_rate"] == 1.0
    checks = {c["name"]: c for c in gate["checks"]}
    for name in ("vision_kept", "mtp_kept", "parity_top1_agreement", "batch_invariant"):
        assert checks[name]["passed"], name
    selection = json.loads((out / "quantize" / "selection.json").read_text())
    assert selection["vision"]["tensors"] > 4 and selection["mtp"]["tensors"] > 0
    # recipes/glm5_next.yaml keeps KDA's gates in BF16; the config names them as stored, too
    assert selection["layers"]["model.language_model.layers.0.self_attn.f_a_proj"]["format"] == "bf16"
    ignore = json.loads((out / "artifact" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.language_model.layers.0.self_attn.f_a_proj" in ignore
    # its MTP layer served as a draft, on the source and on the artifact
    mtp = json.loads((out / "speculator" / "metrics.json").read_text())["mtp"]
    assert mtp["bf16"]["num_drafts"] > 0 and mtp["artifact"]["num_drafts"] > 0
