"""`torchrun -m onboard quantize`: llm-compressor's distributed oneshot, two CPU processes on gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_run import onboard
from datasets import Dataset

from onboard.budget import estimate, model_shape
from onboard.errors import OnboardError
from onboard.quantize import distributed


def torchrun(args: list[str], ranks: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return subprocess.run([*command, "-m", "onboard", *args], capture_output=True, text=True, env=env, timeout=600)


def _errors(done: subprocess.CompletedProcess) -> str:
    """The ranks' own error lines: torchrun's summary below them would push them out of view."""
    lines = [line for line in done.stderr.splitlines() if "onboard: error" in line or "Error" in line]
    return "\n".join(lines[-20:]) or done.stderr[-2000:]


@pytest.mark.multiprocess  # torchrun ranks: `make test-dist` runs them alone
def test_two_ranks_write_one_process_artifact(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """The calibration samples split across two ranks give the artifact one process gives (streamed),
    byte for byte, and a second torchrun finds the stage done on every rank."""
    in_memory, streamed = estimate("quantize", model_shape(tiny_llama), 4 * 64)
    calibration = ["--num-samples", "4", "--max-seq-length", "64", "--method", "rtn"]
    budget = ["--max-memory", str((in_memory + streamed) // 2)]
    assert onboard(["quantize", str(tiny_llama), "--out", str(tmp_path / "one"), *calibration, *budget], capsys)[0] == 0
    args = ["quantize", str(tiny_llama), "--out", str(tmp_path / "two"), *calibration]
    done = torchrun(args)
    assert done.returncode == 0, _errors(done)
    one, two = tmp_path / "one", tmp_path / "two"
    files = sorted(p.name for p in (one / "artifact").iterdir())
    assert files == sorted(p.name for p in (two / "artifact").iterdir())
    for name in files:
        assert (one / "artifact" / name).read_bytes() == (two / "artifact" / name).read_bytes(), name
    assert (one / "quantize/selection.json").read_text() == (two / "quantize/selection.json").read_text()
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["stages"]["quantize"]["metrics"]["memory_path"] == "streamed"
    again = torchrun(args)
    assert again.returncode == 0, _errors(again)
    assert "cached, inputs unchanged" in again.stdout + again.stderr
    assert json.loads((two / "manifest.json").read_text())["stages"]["quantize"] == manifest["stages"]["quantize"]


@pytest.mark.parametrize(("samples", "ranks"), [(10, 3), (4, 2), (7, 7), (5, 1)])
def test_shares_are_contiguous_disjoint_and_cover_the_samples(
    samples: int, ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = Dataset.from_dict({"index": list(range(samples))})
    seen = []
    for rank in range(ranks):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        monkeypatch.setenv("RANK", str(rank))
        seen.append(distributed.share(dataset)["index"])
    assert [i for share in seen for i in share] == list(range(samples))
    assert max(map(len, seen)) - min(map(len, seen)) <= 1


def test_what_ranks_cannot_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(OnboardError, match=r"^--scheme auto selects in one process"):
        distributed.check("auto", 16)
    with pytest.raises(OnboardError, match=r"^--num-samples 1 gives some of the 2 ranks no calibration sample$"):
        distributed.check("nvfp4", 1)
    distributed.check("nvfp4", 2)
    if not torch.accelerator.is_available():  # llm-compressor all-reduces AWQ's sums on the accelerator
        with pytest.raises(OnboardError, match=r"^AWQ under torchrun needs an accelerator"):
            distributed.check("nvfp4", 2, "awq")
    distributed.check("nvfp4", 2, "smoothquant")
