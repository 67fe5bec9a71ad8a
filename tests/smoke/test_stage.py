"""The smoke stage end to end on tiny models: a model made to loop is flagged against its
reference, an unchanged one is not, greedy output is batch invariant, results are deterministic."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from onboard.gate import evaluate_gate
from onboard.recipes import Smoke
from onboard.smoke.stage import measure_smoke, run_smoke
from onboard.workspace import RunDir

CONFIG = Smoke(
    num_prompts=8,
    max_tokens=40,
    loop_min_span=16,
    invariance_prompts=3,
    invariance_max_tokens=16,
    num_examples=4,
)
PROMPTS = [
    "Tell me about the weather today.",
    "Write a function that adds two numbers.",
    "What is seven times eight?",
    "Summarize: the cat sat on the mat all day long.",
    "Give me a JSON object with a name field.",
    "Why is the sky blue?",
    "List three fruits.",
    "Explain recursion briefly.",
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("smoke_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def looping_checkpoint(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with its layers' outputs zeroed and lm_head set to the scaled embedding:
    the residual stream is the current token's embedding, so the likeliest next token is the
    current one (a bias toward repeating the previous token, as a broken quantization might give)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 20)
    out = tmp_path_factory.mktemp("looping")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny_llama / name).is_file():
            shutil.copy(tiny_llama / name, out / name)
    return out


def make_run_dir(root: Path, artifact: Path, reference: Path) -> Path:
    """A run directory whose quantize stage is done, with `artifact` as its artifact."""
    shutil.copytree(artifact, root / "artifact")
    quantize = {"status": "done", "key": "k", "inputs": {"model_path": str(reference)}, "metrics": {}}
    (root / "manifest.json").write_text(json.dumps({"run_dir": str(root), "stages": {"quantize": quantize}}))
    return root


def test_a_model_made_to_loop_is_flagged_against_its_reference(
    tiny_llama: Path, looping_checkpoint: Path, prompts_file: Path, tmp_path: Path
) -> None:
    run_dir = make_run_dir(tmp_path / "run", looping_checkpoint, tiny_llama)
    with RunDir(run_dir) as run:
        run_smoke(run, CONFIG, prompts_file)
    result = json.loads((run_dir / "smoke/smoke.json").read_text())
    assert result["num_prompts"] == len(PROMPTS) and result["modes"] == ["greedy", "sampled"]
    assert result["loop_rate"] >= 0.9
    assert result["loop_rate"] - result["reference_loop_rate"] >= 0.5
    assert result["distinct_2"] < result["reference_distinct_2"]
    assert result["entropy_ratio"] < 1
    loops = [case for case in result["cases"] if case["kind"] == "loop"]
    assert loops and len(result["cases"]) <= CONFIG.num_examples
    for case in loops:
        span = case["artifact_loop"]
        assert span["span"] >= CONFIG.loop_min_span and span["span"] >= 3 * span["period"]
        assert 0 <= span["char_start"] <= len(case["artifact_text"])
        assert case["prompt"] in PROMPTS
    # The gate reads the excess over the reference.
    (run_dir / "manifest.json").write_text(json.dumps(RunDir(run_dir).manifest()))
    checks = {c["name"]: c for c in evaluate_gate(run_dir)["checks"]}
    assert not checks["loop_rate_excess"]["passed"]
    assert checks["loop_rate_excess"]["value"] == pytest.approx(result["loop_rate"] - result["reference_loop_rate"])


def test_an_unchanged_model_matches_its_reference_and_is_batch_invariant(tiny_llama: Path, prompts_file: Path) -> None:
    first = measure_smoke(tiny_llama, tiny_llama, CONFIG, prompts_file)
    assert set(first.pop("throughput")) == {
        f"{side}_{mode}_tokens_per_s" for side in ("artifact", "reference") for mode in ("greedy", "sampled")
    }
    for detector in first["detectors"]:
        assert detector["artifact"] == detector["reference"] and detector["difference"] == 0, detector["name"]
    assert first["entropy_ratio"] == 1.0 and first["run_on_rate"] == 0.0
    assert first["batch_invariant"] and first["invariance"]["diverged"] == []
    assert first["invariance"]["prompts"] == CONFIG.invariance_prompts
    assert len(first["invariance"]["compositions"]) == 4
    assert first["speculative"] is None
    assert first["mean_entropy"] > 0 and 0 < first["distinct_2"] <= 1
    # Same inputs, same results (timings live in the manifest, not here).
    again = measure_smoke(tiny_llama, tiny_llama, CONFIG, prompts_file)
    again.pop("throughput")
    assert again == first
