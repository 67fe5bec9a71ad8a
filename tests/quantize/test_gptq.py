"""`--method gptq`: llmcompressor's GPTQModifier in the quantize stage and inside `auto`."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from artifacts import quantize_into

from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize.calibration import calibration_dataset
from onboard.recipes import Calibration, Quantize, Search

CALIB = Calibration(num_samples=4, max_seq_length=64)
MODULE = "model.layers.0.self_attn.q_proj"


def modifiers(artifact: Path) -> set[str]:
    stage = yaml.safe_load((artifact / "recipe.yaml").read_text())["default_stage"]["default_modifiers"]
    return set(stage)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Path]:
    return {
        algorithm: quantize_into(
            tmp_path_factory.mktemp(algorithm),
            tiny_llama,
            Quantize(scheme="nvfp4a16", method=algorithm, calibration=CALIB),
        )
        for algorithm in ("rtn", "gptq")
    }


def test_gptq_runs_through_llmcompressor(artifacts) -> None:
    assert modifiers(artifacts["gptq"]) == {"GPTQModifier"}
    assert modifiers(artifacts["rtn"]) == {"QuantizationModifier"}
    selection = json.loads((artifacts["gptq"].parent / "quantize/selection.json").read_text())
    assert selection["method"] == "gptq"


def test_gptq_reconstructs_calibration_outputs_better_than_rtn(artifacts, tiny_llama: Path) -> None:
    """GPTQ minimises ||XWᵀ - XŴᵀ|| on calibration activations X; on the first layer's inputs
    (the same for both, weight-only quantization upstream of nothing) it must beat rounding."""
    checkpoint = inspect_checkpoint(tiny_llama)
    reference = load_model(checkpoint)
    ids = torch.tensor(calibration_dataset(load_tokenizer(checkpoint), CALIB, None)["input_ids"])
    captured = []
    handle = reference.get_submodule(MODULE).register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    with torch.no_grad():
        reference(ids)
    handle.remove()
    x = captured[0].reshape(-1, captured[0].shape[-1]).float()
    original = reference.get_submodule(MODULE).weight.float()
    errors = {}
    for algorithm, artifact in artifacts.items():
        weight = load_model(inspect_checkpoint(artifact)).get_submodule(MODULE).weight.float()
        assert not torch.equal(weight, original)
        errors[algorithm] = float((x @ (weight - original).T).detach().norm())
    assert errors["gptq"] < errors["rtn"]


def test_auto_search_uses_gptq_sources(tmp_path: Path, tiny_llama: Path) -> None:
    settings = Quantize(
        scheme="auto", bits_budget=5.5, method="gptq", calibration=CALIB, search=Search(tokens=128, steps=2)
    )
    artifact = quantize_into(tmp_path, tiny_llama, settings)
    assert modifiers(artifact) == {"GPTQModifier"}
    selection = json.loads((tmp_path / "quantize/selection.json").read_text())
    assert selection["method"] == "gptq" and selection["search"]
