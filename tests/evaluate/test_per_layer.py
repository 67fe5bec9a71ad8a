"""`eval`'s per-layer KL: each layer alone as in the artifact, and the running KL."""

import json
from pathlib import Path

import pytest
import torch
from build_once import copy_of

from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.evaluate.per_layer import batch_windows
from onboard.evaluate.stage import eval_windows, run_eval
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import Calibration, Eval, Quantize
from onboard.workspace import RunDir

CALIB = Calibration(num_samples=2, max_seq_length=64)
EVAL = Eval(max_tokens=1024, window=64, per_layer_tokens=256)
LAYER_0 = ["re:.*layers\\.0\\..*"]


@pytest.fixture(scope="module")
def quantized_copy(quantized_run, tiny_llama: Path):
    """A private copy, at `root`, of the shared run that quantized tiny_llama with `settings`."""
    return lambda root, settings: copy_of(quantized_run(tiny_llama, settings), root)


def evaluated(root: Path, quantized_copy, settings: Quantize) -> dict:
    quantized_copy(root, settings)
    with RunDir(root) as run:
        run_eval(run, EVAL, None)
    return json.loads((root / "eval/kl.json").read_text())


@pytest.fixture(scope="module")
def uniform(tmp_path_factory: pytest.TempPathFactory, quantized_copy) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("uniform") / "run"
    return root, evaluated(root, quantized_copy, Quantize(calibration=CALIB))


def test_per_layer_rows(uniform) -> None:
    _, result = uniform
    per_layer = result["per_layer"]
    layers = per_layer["layers"]
    assert [row["layer"] for row in layers] == [0, 1]
    assert all(row["formats"] == {"nvfp4": 7} for row in layers)
    assert layers[0]["running_kld"] == layers[0]["alone_kld"]  # nothing before layer 0
    assert layers[-1]["running_kld"] == per_layer["full_kld"]
    assert all(row["alone_kld"] > 0 for row in layers)


def test_full_kld_is_the_artifacts_kl_on_the_same_tokens(uniform, tiny_llama: Path) -> None:
    """Swapping every artifact layer into the reference gives the artifact: the same KL as the
    plain eval path computes on those windows, one window at a time."""
    root, result = uniform
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    ids = batch_windows(eval_windows(tokenizer, EVAL, None), EVAL.per_layer_tokens)
    assert ids.numel() == result["per_layer"]["tokens"]
    reference, quantized = load_model(inspect_checkpoint(tiny_llama)), load_model(inspect_checkpoint(root / "artifact"))
    stats = KLStats()
    for window in ids:
        chunks = zip(logit_chunks(reference, window[None], 64), logit_chunks(quantized, window[None], 64), strict=True)
        for ref, quant in chunks:
            stats.update(ref, quant, torch.zeros(len(ref), dtype=torch.long))
    assert result["per_layer"]["full_kld"] == pytest.approx(stats.summary()["mean_kld"], rel=1e-2)


def test_a_layer_kept_in_bf16_adds_nothing(tmp_path: Path, quantized_copy) -> None:
    result = evaluated(tmp_path / "run", quantized_copy, Quantize(formats={"bf16": LAYER_0}, calibration=CALIB))
    first, second = result["per_layer"]["layers"]
    assert first["formats"] == {"bf16": 7}
    assert first["alone_kld"] < 1e-6 and first["running_kld"] < 1e-6
    assert second["alone_kld"] == second["running_kld"] == result["per_layer"]["full_kld"] > 0


def test_per_layer_can_be_switched_off(tmp_path: Path, quantized_copy) -> None:
    root = quantized_copy(tmp_path / "run", Quantize(scheme="nvfp4a16", calibration=CALIB))
    with RunDir(root) as run:
        run_eval(run, EVAL.model_copy(update={"per_layer_tokens": 0}), None)
    assert "per_layer" not in json.loads((root / "eval/kl.json").read_text())


def test_batch_windows_take_traffic_types_in_turn() -> None:
    windows = [("chat", [1] * 4), ("chat", [2] * 4), ("chat", [3] * 2), ("code", [4] * 4), ("math", [5] * 4)]
    assert batch_windows(windows, 12).tolist() == [[1] * 4, [4] * 4, [5] * 4]
    assert batch_windows(windows, 100).tolist() == [[1] * 4, [4] * 4, [5] * 4, [2] * 4]  # short windows left out
