"""`--distill-tokens`: NVFP4 block scales trained on KL to the unquantized model, kept only when the
calibration KL does not rise, saved as a plain NVFP4 checkpoint."""

import json
from pathlib import Path

import pytest
import torch
from artifacts import quantize_into, stored_tensors

from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.distill import calibration_kl, distill_windows
from onboard.recipes import Calibration, Quantize

CALIB = Calibration(num_samples=4, max_seq_length=64)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[int, Path]:
    return {
        tokens: quantize_into(
            tmp_path_factory.mktemp(f"distill{tokens}"),
            tiny_llama,
            Quantize(scheme="nvfp4", calibration=CALIB, distill_tokens=tokens),
        )
        for tokens in (0, 256)
    }


def test_distillation_does_not_raise_calibration_kl(artifacts, tiny_llama: Path) -> None:
    record = json.loads((artifacts[256].parent / "quantize/selection.json").read_text())["distill"]
    assert record["tokens"] == 256 and record["steps"] > 0
    assert record["calibration_kld_after"] <= record["calibration_kld_before"]
    # Measured again on the saved artifacts, against the one made without distillation.
    checkpoint = inspect_checkpoint(tiny_llama)
    reference = load_model(checkpoint)
    dataset = calibration_dataset(load_tokenizer(checkpoint), CALIB, None)
    windows = distill_windows(dataset["input_ids"], 256)
    plain, distilled = (
        calibration_kl(load_model(inspect_checkpoint(artifacts[t])), reference, windows) for t in (0, 256)
    )
    # On this tiny model a few steps always find lower-KL scales: they are kept and saved.
    assert record["kept"] and record["scales_changed"] > 0
    assert distilled < plain


def test_the_distilled_artifact_is_plain_nvfp4(artifacts) -> None:
    plain, distilled = (stored_tensors(artifacts[t]) for t in (0, 256))
    assert plain.keys() == distilled.keys()
    for name, tensor in plain.items():
        assert (tensor.dtype, tensor.shape) == (distilled[name].dtype, distilled[name].shape), name
    scales = [name for name in plain if name.endswith(".weight_scale")]
    assert scales and all(plain[name].dtype == torch.float8_e4m3fn for name in scales)
    assert any(not torch.equal(plain[n].float(), distilled[n].float()) for n in scales)  # trained
    configs = [json.loads((artifacts[t] / "config.json").read_text())["quantization_config"] for t in (0, 256)]
    assert configs[0]["config_groups"] == configs[1]["config_groups"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"scheme": "fp8", "distill_tokens": 256}, "scheme fp8 has none"),
        ({"distill_tokens": 1}, "at least 2 tokens"),
        ({"scheme": "nvfp4a16", "method": "autoround"}, "autoround tunes NVFP4 W4A4"),
    ],
)
def test_settings_distillation_or_autoround_cannot_honour_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Quantize(**settings)
