"""NVFP4 as vLLM's compressed-tensors loader reads it, in a uniform and in a mixed-precision
checkpoint: tensor names, dtypes and shapes, and the global scales fused layers must share."""

import json
from pathlib import Path

import pytest
import torch
from artifacts import stored_tensors
from transformers import AutoModelForCausalLM

from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize import modifiers
from onboard.quantize.calibration import calibration_dataset
from onboard.recipes import Calibration, Quantize

CALIB = Calibration(num_samples=2, max_seq_length=64)
PINS = {
    "fp8": ["re:.*layers\\.0\\.self_attn\\.(q|k|v|o)_proj$"],
    "bf16": ["re:.*layers\\.1\\.mlp\\.down_proj$"],
}
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@pytest.fixture(scope="module")
def artifacts(quantized_run, tiny_llama: Path) -> dict[str, Path]:
    return {
        "uniform": quantized_run(tiny_llama, Quantize(calibration=CALIB)) / "artifact",
        "mixed": quantized_run(tiny_llama, Quantize(formats=PINS, calibration=CALIB)) / "artifact",
    }


def nvfp4_modules(stored: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name.removesuffix(".weight_packed") for name in stored if name.endswith(".weight_packed"))


@pytest.mark.parametrize("kind", ["uniform", "mixed"])
def test_nvfp4_tensors_are_what_vllm_loads(artifacts, tiny_llama: Path, kind: str) -> None:
    stored = stored_tensors(artifacts[kind])
    reference = stored_tensors(tiny_llama)
    modules = nvfp4_modules(stored)
    assert modules
    for module in modules:
        out, inp = reference[f"{module}.weight"].shape
        assert f"{module}.weight" not in stored
        expected = {
            "weight_packed": (torch.uint8, (out, inp // 2)),
            "weight_scale": (torch.float8_e4m3fn, (out, inp // 16)),
            "weight_global_scale": (torch.float32, (1,)),
            "input_global_scale": (torch.float32, (1,)),
        }
        for part, (dtype, shape) in expected.items():
            tensor = stored[f"{module}.{part}"]
            assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape), f"{module}.{part}"
        assert set(k.rpartition(".")[2] for k in stored if k.startswith(module + ".")) == set(expected)


@pytest.mark.parametrize("kind", ["uniform", "mixed"])
def test_fused_layers_share_global_scales(artifacts, kind: str) -> None:
    stored = stored_tensors(artifacts[kind])
    modules = set(nvfp4_modules(stored))
    checked = 0
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        for fused in FUSED:
            if leaf == fused[0]:
                for part in ("weight_global_scale", "input_global_scale"):
                    values = {stored[f"{parent}.{p}.{part}"].item() for p in fused}
                    assert len(values) == 1, f"{parent} {fused} {part}: {values}"
                checked += 1
    assert checked >= (4 if kind == "uniform" else 2)


def test_mixed_checkpoint_layout(artifacts) -> None:
    stored = stored_tensors(artifacts["mixed"])
    config = json.loads((artifacts["mixed"] / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    assert sorted(g["format"] for g in config["config_groups"].values()) == [
        "float-quantized",
        "nvfp4-pack-quantized",
    ]
    assert "model.layers.1.mlp.down_proj" in config["ignore"]
    for proj in "qkvo":
        module = f"model.layers.0.self_attn.{proj}_proj"
        assert stored[f"{module}.weight"].dtype == torch.float8_e4m3fn
        assert stored[f"{module}.weight_scale"].shape == (stored[f"{module}.weight"].shape[0], 1)
    assert stored["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.self_attn.q_proj.weight_packed" in stored


def test_mixed_checkpoint_reloads_with_the_in_memory_logits(artifacts, tiny_llama: Path) -> None:
    checkpoint = inspect_checkpoint(tiny_llama)
    tokenizer = load_tokenizer(checkpoint)
    settings = Quantize(formats=PINS, calibration=CALIB)
    model = load_model(checkpoint)
    dataset = calibration_dataset(tokenizer, CALIB, None)
    modifiers.apply(model, tokenizer, modifiers.modifier(settings, "nvfp4", PINS), dataset, CALIB.max_seq_length)
    reloaded = AutoModelForCausalLM.from_pretrained(artifacts["mixed"], dtype=torch.bfloat16).eval()
    ids = torch.tensor([dataset["input_ids"][0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
