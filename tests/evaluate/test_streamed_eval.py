"""The two-pass streamed eval against the in-memory eval: the same statistics, one layer resident."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from build_once import copy_of

from onboard.budget import estimate, model_shape
from onboard.evaluate import streamed
from onboard.evaluate.stage import eval_plan, eval_windows, run_eval
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.models.streamed import StreamedModel
from onboard.recipes import Calibration, Eval, Quantize
from onboard.workspace import RunDir

CALIB = Calibration(num_samples=2, max_seq_length=64)
EVAL = Eval(max_tokens=512, window=64, per_layer_tokens=128)
# A dense, a MoE, an MLA+DSA and a linear-attention family: the streamed path differs by layer
# kind, not by family (DeepSeek-V3 and GLM-5 are DeepSeek-V3.2's layers less the indexer).
FAMILIES = ["tiny_llama", "tiny_qwen3_moe", "tiny_deepseek_v32", "tiny_qwen3_5_moe"]


def streaming_budget(reference: Path, artifact: Path, settings: Eval) -> int:
    """A budget the streamed path fits and the in-memory path does not."""
    shape = model_shape(artifact)
    tokens = settings.max_tokens + shape.num_layers * settings.per_layer_tokens
    in_memory, streamed_peak = estimate("eval", shape, tokens, model_shape(reference))
    assert streamed_peak < in_memory
    return (in_memory + streamed_peak) // 2


def evaluate(run_root: Path, max_memory: int | None) -> tuple[str, dict]:
    with RunDir(run_root) as run:
        entry = run_eval(run, EVAL, None, max_memory=max_memory)
    return (run_root / "eval/kl.json").read_text(), entry["metrics"]


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_eval_equals_in_memory(
    family: str, request: pytest.FixtureRequest, quantized_run, tmp_path: Path
) -> None:
    """Bitwise: the same layers in the same order on the same rows, and the same logit chunks."""
    checkpoint = request.getfixturevalue(family)
    quantized = quantized_run(checkpoint, Quantize(calibration=CALIB))
    in_memory_root, streamed_root = (
        copy_of(quantized, tmp_path / "in_memory"),
        copy_of(quantized, tmp_path / "streamed"),
    )
    budget = streaming_budget(checkpoint, streamed_root / "artifact", EVAL)
    assert eval_plan(model_shape(streamed_root / "artifact"), model_shape(checkpoint), EVAL, budget).path == "streamed"

    expected, expected_metrics = evaluate(in_memory_root, None)
    got, metrics = evaluate(streamed_root, budget)
    assert (expected_metrics["memory_path"], metrics["memory_path"]) == ("in-memory", "streamed")
    assert json.loads(got)["per_layer"]["layers"], "the per-layer KL was measured"
    assert got == expected


def test_reference_states_are_cached_and_rebuilt(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ONBOARD_CACHE", str(tmp_path / "cache"))  # not the other tests' states
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    windows = eval_windows(tokenizer, EVAL, None)
    first, cached = streamed.reference_states(tiny_llama, windows)
    assert not cached
    again, cached = streamed.reference_states(tiny_llama, windows)
    assert cached and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # other tokens: computed anew
    _, cached = streamed.reference_states(tiny_llama, windows[:-1])
    assert not cached
    # another reference (one stored tensor changed): computed anew, and different
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(other / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 2
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    changed, cached = streamed.reference_states(other, windows)
    assert not cached
    assert not torch.equal(changed[0], first[0])


def test_streamed_passes_hold_one_layer_per_model(tiny_deepseek_v3: Path, quantized_run) -> None:
    artifact = quantized_run(tiny_deepseek_v3, Quantize(calibration=CALIB)) / "artifact"
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    model = StreamedModel(artifact)
    model.final_hidden([ids], "test")
    assert model.parts.peak_layers == 1
    models = []
    original = streamed.StreamedModel

    class Counted(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            models.append(self)

    streamed.StreamedModel = Counted
    try:
        streamed.streamed_per_layer_kl(tiny_deepseek_v3, artifact, ids, {})
    finally:
        streamed.StreamedModel = original
    assert [m.parts.peak_layers for m in models] == [1, 1]


def test_over_budget_even_streamed_refuses_before_writing(tiny_llama: Path, quantized_run, tmp_path: Path) -> None:
    from onboard.errors import OnboardError

    root = copy_of(quantized_run(tiny_llama, Quantize(calibration=CALIB)), tmp_path / "run")
    refusal = r"^eval needs about .* streamed, over the .* budget \(--max-memory\)"
    with pytest.raises(OnboardError, match=refusal), RunDir(root) as run:
        run_eval(run, EVAL, None, max_memory=1000)
    assert not (root / "eval").exists()
    assert "eval" not in json.loads((root / "manifest.json").read_text())["stages"]
