"""The speculator stage on an artifact that keeps its MTP layers: their acceptance on the BF16
source and on the artifact, measured on the same held-out prompts, and `--draft mtp`: the layers
fine-tuned on the artifact's own states and written back into it when they accept more."""

import json
import shutil
from pathlib import Path

import pytest
import tiny_models

from onboard.gate import evaluate_gate
from onboard.models import inspect_checkpoint
from onboard.models.headers import safetensors_entries
from onboard.models.mtp import mtp_entries
from onboard.quantize.stage import run_quantize
from onboard.recipes import Calibration, Quantize, recipe_for
from onboard.report import write_report
from onboard.speculator.stage import run_speculator
from onboard.workspace import RunDir

SETTINGS = tiny_models.mtp_speculator_settings()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_mtp_predictable: Path) -> Path:
    """tiny_mtp_predictable quantized to NVFP4 (W4A4) with the DeepSeek-V3 recipe, then `--draft mtp`."""
    root = tmp_path_factory.mktemp("mtp_run")
    recipe, _ = recipe_for(["DeepseekV3ForCausalLM"])
    data = {
        **recipe.quantize.model_dump(),
        "scheme": "nvfp4",
        "calibration": Calibration(num_samples=2, max_seq_length=64).model_dump(),
    }
    with RunDir(root) as run:
        run_quantize(run, inspect_checkpoint(tiny_mtp_predictable), Quantize.model_validate(data), None)
        entry = run_speculator(run, SETTINGS, None, numerics="exact")
    assert entry["status"] == "done"
    return root


def test_fine_tuning_raises_acceptance_and_is_written_back(run_dir: Path, tiny_mtp_predictable: Path) -> None:
    metrics = json.loads((run_dir / "speculator/metrics.json").read_text())
    mtp = metrics["mtp"]
    assert metrics["draft"] == "mtp" and metrics["aux_layers"] == [tiny_models.DEEPSEEK_LAYERS]
    assert set(mtp) >= {"bf16", "artifact", "retrained", "written_back", "acceptance_ratio"}
    # The shipped random MTP layer knows nothing of the model's cycle; fine-tuned, it predicts it.
    assert mtp["retrained"]["acceptance_length"] > mtp["artifact"]["acceptance_length"] + 0.3
    assert mtp["written_back"] and metrics["acceptance_length"] == mtp["retrained"]["acceptance_length"]
    assert all(row["spec_lossless_greedy"] for row in (mtp["artifact"], mtp["retrained"]))
    # Written back in the checkpoint's own names and dtypes: the layer's weights changed, the
    # shared embedding and head copies did not, and the gate still finds every MTP tensor.
    source, artifact = mtp_entries(tiny_mtp_predictable), safetensors_entries(run_dir / "artifact")
    assert set(source) <= set(artifact)
    mtp = f"model.layers.{tiny_models.DEEPSEEK_LAYERS}"
    assert artifact[f"{mtp}.eh_proj.weight"].read() != source[f"{mtp}.eh_proj.weight"].read()
    for name in (f"{mtp}.embed_tokens.weight", f"{mtp}.shared_head.head.weight"):
        assert artifact[name].read() == source[name].read()
    assert all((artifact[n].dtype, artifact[n].shape) == (source[n].dtype, source[n].shape) for n in source)
    check = next(c for c in evaluate_gate(run_dir)["checks"] if c["name"] == "mtp_kept")
    assert check["passed"]


def test_the_report_shows_what_quantization_did_to_the_mtp_layers(run_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(run_dir, tmp_path / "run"))
    html = write_report(copy).read_text()
    assert "The model&#39;s own MTP layers" in html or "The model's own MTP layers" in html
    for row in ("BF16 source", "quantized artifact", "artifact, fine-tuned"):
        assert row in html


def test_an_artifact_without_mtp_layers_refuses_draft_mtp(tiny_deepseek_v3: Path, tmp_path: Path) -> None:
    from onboard.errors import OnboardError

    recipe, _ = recipe_for(["DeepseekV3ForCausalLM"])
    data = {**recipe.quantize.model_dump(), "scheme": "nvfp4a16"}
    with RunDir(tmp_path) as run:
        run_quantize(run, inspect_checkpoint(tiny_deepseek_v3), Quantize.model_validate(data), None)
        with pytest.raises(OnboardError, match="has no MTP layers"):
            run_speculator(run, SETTINGS, None, numerics="exact")


def test_bench_measures_the_mtp_layers_of_an_artifact_without_an_export(run_dir: Path) -> None:
    from onboard.speculator.measure import run_spec_bench

    result = run_spec_bench(run_dir / "artifact", Path("mtp"), [], None, num_prompts=2, max_tokens=12)
    assert set(result["speculators"]) == {"mtp"}
    assert result["spec_lossless_greedy"] and len(result["spec_per_position_acceptance"]) == 1  # K: one per layer


def test_an_eagle3_run_measures_the_mtp_layers_too(run_dir: Path, tmp_path: Path) -> None:
    """The default draft on an MTP artifact: an EAGLE-3 head is trained and exported, and the MTP
    layers' acceptance on the BF16 source and on the artifact is measured beside it."""
    copy = Path(shutil.copytree(run_dir, tmp_path / "run"))
    eagle = SETTINGS.model_copy(
        update={"draft": "eagle3", "num_prompts": 4, "epochs": 1, "draft_vocab_size": 96, "eval_prompts": 2}
    )
    with RunDir(copy) as run:
        run_speculator(run, eagle, None, numerics="exact")
    metrics = json.loads((copy / "speculator/metrics.json").read_text())
    assert metrics["draft"] == "eagle3" and (copy / "artifact/speculator/config.json").is_file()
    assert metrics["mtp"]["bf16"] is not None and metrics["mtp"]["num_prompts"] == 2
    assert "retrained" not in metrics["mtp"]
