"""`--distill-tokens`: NVFP4 block scales trained on KL to the unquantized model, the epoch kept that
lowers the KL on held-back calibration text most (none if none does), saved as a plain NVFP4
checkpoint."""

import json
from pathlib import Path

import pytest
import torch
from artifacts import quantize_into, stored_tensors

from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize import distill
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.distill import calibration_kl, distill_windows
from onboard.recipes import Calibration, Quantize

CALIB = Calibration(num_samples=8, max_seq_length=64)  # one sequence held back, 448 tokens to train on


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
    assert record["tokens"] == 256 and record["steps"] == distill.EPOCHS * 4 and record["held_back_tokens"] == 64
    assert len(record["held_back_kld_by_epoch"]) == distill.EPOCHS
    assert record["held_back_kld_after"] <= record["held_back_kld_before"]
    assert record["held_back_kld_after"] == pytest.approx(min(record["held_back_kld_by_epoch"]), rel=1e-4)
    # Measured again on the saved artifacts, against the one made without distillation, on the
    # text that judged it and on the text it trained on.
    checkpoint = inspect_checkpoint(tiny_llama)
    reference = load_model(checkpoint)
    dataset = calibration_dataset(load_tokenizer(checkpoint), CALIB, None)
    windows, held_back = distill_windows(dataset["input_ids"], 256)
    models = {t: load_model(inspect_checkpoint(artifacts[t])) for t in (0, 256)}
    # On this tiny model a few steps always find lower-KL scales: they are kept and saved.
    assert record["kept"] and record["scales_changed"] > 0 and record["best_epoch"] >= 1
    assert calibration_kl(models[256], reference, held_back) < calibration_kl(models[0], reference, held_back)
    assert calibration_kl(models[256], reference, windows) < calibration_kl(models[0], reference, windows)


def test_no_epoch_that_raises_the_held_back_kl_is_kept(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built to fail: steps far too large wreck the scales, every epoch's held-back KL rises, and
    the scales llm-compressor found are left as they were."""
    from onboard.quantize.modifiers import apply, modifier

    checkpoint = inspect_checkpoint(tiny_llama)
    tokenizer, reference = load_tokenizer(checkpoint), load_model(checkpoint)
    settings = Quantize(scheme="nvfp4", calibration=CALIB)
    dataset = calibration_dataset(tokenizer, CALIB, None)
    student = load_model(checkpoint)
    apply(student, tokenizer, modifier(settings, "nvfp4"), dataset, CALIB.max_seq_length)
    scales = {n: p.clone() for n, p in student.named_parameters() if n.endswith("weight_scale")}
    monkeypatch.setattr(distill, "LEARNING_RATE", 3.0)
    monkeypatch.setattr(distill, "EPOCHS", 2)
    record = distill.distill_scales(student, reference, *distill_windows(dataset["input_ids"], 128))
    assert all(kl > record["held_back_kld_before"] for kl in record["held_back_kld_by_epoch"])
    assert not record["kept"] and record["best_epoch"] == 0 and record["scales_changed"] == 0
    assert record["held_back_kld_after"] == record["held_back_kld_before"]
    for name, param in student.named_parameters():
        if name in scales:
            assert torch.equal(param.view(torch.uint8), scales[name].view(torch.uint8)), name


def test_held_back_sequences_are_never_trained_on() -> None:
    sequences = [[i] * 10 for i in range(16)]
    windows, held_back = distill_windows(sequences, 1000)
    assert [w[0].item() for w in held_back] == [14, 15]  # the last eighth, whole
    assert [w[0].item() for w in windows] == list(range(14))
    windows, held_back = distill_windows(sequences, 25)
    assert [len(w) for w in windows] == [10, 10, 5] and len(held_back) == 2
    assert distill_windows(sequences[:1], 5)[1] == []  # one sequence: nothing to hold back


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
