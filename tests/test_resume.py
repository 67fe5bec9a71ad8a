"""Stages are cached by their inputs, atomic, and resumable after SIGKILL.

The first half drives `RunDir.run_stage` in-process with a toy stage; the second runs the real
`onboard quantize` in a process of its own (forked from a warm interpreter: tests/cli_process.py),
kills it with SIGKILL mid-stage and resumes it.
"""

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_process import Finished

from onboard.errors import OnboardError
from onboard.hashing import fingerprint
from onboard.models.checkpoint import check_safetensors
from onboard.workspace import RunDir, Stage

# ---------------------------------------------------------------------------------------------
# run_stage, in-process
# ---------------------------------------------------------------------------------------------


class Toy:
    """A stage body that writes `out/x.txt` and counts its calls."""

    def __init__(self, text: str = "hello", check: Callable[[Stage], None] | None = None):
        self.text = text
        self.check = check
        self.calls = 0

    def __call__(self, stage: Stage) -> dict[str, Any]:
        self.calls += 1
        stage.path("out/x.txt").write_text(self.text)
        if self.check:
            self.check(stage)
        return {"chars": len(self.text)}


def toy_stage(root: Path, body: Callable[[Stage], dict[str, Any]], n: int = 1) -> dict[str, Any]:
    with RunDir(root) as run:
        return run.run_stage("toy", {"n": n}, outputs=["out"], body=body)


def manifest_entry(root: Path, name: str = "toy") -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())["stages"][name]


def test_second_call_with_same_inputs_is_cached(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    body = Toy()
    first = toy_stage(tmp_path, body)
    assert body.calls == 1
    assert (tmp_path / "out" / "x.txt").read_text() == "hello"
    assert first["status"] == "done"
    assert first["metrics"] == {"chars": 5}
    assert first["outputs"] == {"out": fingerprint(tmp_path / "out")}
    assert manifest_entry(tmp_path) == first
    assert "cached" not in capsys.readouterr().err

    again = toy_stage(tmp_path, body)  # a new RunDir: the manifest on disk is what counts
    assert body.calls == 1
    assert again == first
    assert "toy: cached" in " ".join(capsys.readouterr().err.split())


def test_changed_inputs_rerun(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    body = Toy()
    first = toy_stage(tmp_path, body, n=1)
    body.text = "changed"
    second = toy_stage(tmp_path, body, n=2)
    assert body.calls == 2
    assert second["key"] != first["key"]
    assert second["inputs"]["n"] == 2
    assert (tmp_path / "out" / "x.txt").read_text() == "changed"
    assert manifest_entry(tmp_path) == second
    assert "cached" not in capsys.readouterr().err


def test_deleted_output_reruns(tmp_path: Path) -> None:
    body = Toy()
    toy_stage(tmp_path, body)
    (tmp_path / "out" / "x.txt").unlink()
    (tmp_path / "out").rmdir()
    toy_stage(tmp_path, body)
    assert body.calls == 2
    assert (tmp_path / "out" / "x.txt").read_text() == "hello"


def test_outputs_appear_only_after_the_body_returns(tmp_path: Path) -> None:
    toy_stage(tmp_path, Toy("old"))

    def check(stage: Stage) -> None:
        # The new output is staged; readers of RUN_DIR still see the old one, untouched.
        assert stage.staging.is_relative_to(tmp_path)
        assert (stage.staging / "out" / "x.txt").read_text() == "new"
        assert (tmp_path / "out" / "x.txt").read_text() == "old"
        assert manifest_entry(tmp_path)["status"] == "running"

    toy_stage(tmp_path, Toy("new", check), n=2)
    assert (tmp_path / "out" / "x.txt").read_text() == "new"
    assert not (tmp_path / ".staging" / "toy").exists()


def test_outputs_do_not_exist_while_the_first_run_is_in_progress(tmp_path: Path) -> None:
    seen = []
    toy_stage(tmp_path, Toy(check=lambda stage: seen.append((tmp_path / "out").exists())))
    assert seen == [False]
    assert (tmp_path / "out" / "x.txt").exists()


def test_failing_body_leaves_no_output_and_is_marked_failed(tmp_path: Path) -> None:
    def boom(stage: Stage) -> None:
        raise ValueError("boom: the stage broke")

    body = Toy(check=boom)
    with pytest.raises(ValueError, match="boom"):
        toy_stage(tmp_path, body)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / ".staging" / "toy").exists()
    entry = manifest_entry(tmp_path)
    assert entry["status"] == "failed"
    assert "boom" in entry["error"]

    with pytest.raises(ValueError):  # a failed stage is never taken as cached
        toy_stage(tmp_path, body)
    assert body.calls == 2


def test_failing_rerun_keeps_the_previous_output(tmp_path: Path) -> None:
    toy_stage(tmp_path, Toy("good"))

    def boom(stage: Stage) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        toy_stage(tmp_path, Toy("half", check=boom), n=2)
    assert (tmp_path / "out" / "x.txt").read_text() == "good"
    assert manifest_entry(tmp_path)["status"] == "failed"


def test_body_that_writes_no_output_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="did not write out"):
        toy_stage(tmp_path, lambda stage: {})
    assert manifest_entry(tmp_path)["status"] == "failed"
    assert not (tmp_path / "out").exists()


def test_stage_killed_mid_body_is_redone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A process that dies inside the body (no cleanup runs) leaves `running`; the next call
    discards its staged leftovers and redoes the stage."""

    def die(stage: Stage) -> None:
        stage.path("out/partial.bin").write_bytes(b"\0" * 100)
        os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            toy_stage(tmp_path, Toy(check=die))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert manifest_entry(tmp_path)["status"] == "running"
    assert (tmp_path / ".staging" / "toy" / "out" / "partial.bin").exists()
    assert not (tmp_path / "out").exists()

    body = Toy()
    entry = toy_stage(tmp_path, body)  # the dead process's lock went with it
    assert body.calls == 1
    assert entry["status"] == "done"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.txt"]
    assert not (tmp_path / ".staging" / "toy").exists()
    assert "an earlier run did not finish" in " ".join(capsys.readouterr().err.split())


def test_second_rundir_on_a_held_root_is_refused(tmp_path: Path) -> None:
    with RunDir(tmp_path):
        with pytest.raises(OnboardError, match="in use"):
            RunDir(tmp_path).__enter__()
        assert not (tmp_path / "manifest.json").exists()
    with RunDir(tmp_path):  # released: usable again
        pass


def open_fds_on(path: Path) -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == str(path)
        except OSError:
            continue
    return count


def test_refused_rundir_does_not_keep_the_lock_file_open(tmp_path: Path) -> None:
    lock = tmp_path.resolve() / ".lock"
    with RunDir(tmp_path):
        assert open_fds_on(lock) == 1
        refused = RunDir(tmp_path)
        with pytest.raises(OnboardError, match="in use"):
            refused.__enter__()
        assert open_fds_on(lock) == 1


# ---------------------------------------------------------------------------------------------
# The real CLI under SIGKILL
# ---------------------------------------------------------------------------------------------

QUICK = ["--num-samples", "2", "--max-seq-length", "64"]
OUTPUTS = ("artifact/model.safetensors", "quantize/selection.json")


def quantize_args(model: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["quantize", str(model), "--out", str(run_dir), *QUICK, *extra]


def quantize(onboard_process, model: Path, run_dir: Path, *extra: str):
    done = onboard_process.run(quantize_args(model, run_dir, *extra))
    assert "Traceback" not in done.stderr, done.stderr
    return done


def said(done, text: str) -> bool:
    """Whether stderr says `text` (rich wraps long lines at the terminal width)."""
    return text in " ".join(done.stderr.split())


def stage_status(run_dir: Path) -> str | None:
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except FileNotFoundError:
        return None
    return manifest["stages"].get("quantize", {}).get("status")


def quantize_entry(run_dir: Path) -> dict[str, Any]:
    return manifest_entry(run_dir, "quantize")


@dataclass
class Killed:
    run_dir: Path
    returncode: int
    staged: list[str]  # what the killed process had staged
    artifact_existed: bool
    status: str | None
    resumed: Finished
    resumed_entry: dict[str, Any]
    resumed_bytes: dict[str, bytes]


@pytest.fixture(scope="module")
def killed(tiny_llama: Path, onboard_process, tmp_path_factory: pytest.TempPathFactory) -> Killed:
    """`onboard quantize` SIGKILLed while its stage is staging output, then run again."""
    run_dir = tmp_path_factory.mktemp("sigkill") / "run"
    staging = run_dir / ".staging" / "quantize"
    proc = onboard_process.start(quantize_args(tiny_llama, run_dir))
    try:
        deadline = time.monotonic() + 300
        while not (staging.is_dir() and stage_status(run_dir) == "running"):
            assert proc.poll() is None, proc.stderr_path.read_text()
            assert time.monotonic() < deadline, "the quantize stage never started"
            time.sleep(0.01)
        # Better still: kill it once it has started writing the artifact (about a second
        # before it would finish); give up waiting for that after a while.
        wait_for_files = time.monotonic() + 60
        while not any(p.is_file() for p in staging.rglob("*")) and time.monotonic() < wait_for_files:
            assert proc.poll() is None, proc.stderr_path.read_text()
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        returncode = proc.wait().returncode
    staged = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    artifact_existed = (run_dir / "artifact").exists()
    status = stage_status(run_dir)

    resumed = quantize(onboard_process, tiny_llama, run_dir)
    return Killed(
        run_dir=run_dir,
        returncode=returncode,
        staged=staged,
        artifact_existed=artifact_existed,
        status=status,
        resumed=resumed,
        resumed_entry=quantize_entry(run_dir),
        resumed_bytes={name: (run_dir / name).read_bytes() for name in OUTPUTS},
    )


def test_sigkill_mid_stage_leaves_no_artifact_and_stage_running(killed: Killed) -> None:
    assert killed.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert killed.staged, "killed before the stage staged anything"
    assert not killed.artifact_existed
    assert killed.status == "running"


def test_rerun_after_sigkill_redoes_the_stage(killed: Killed) -> None:
    run_dir, resumed = killed.run_dir, killed.resumed
    assert resumed.returncode == 0, resumed.stderr
    assert said(resumed, "quantize: an earlier run did not finish; redoing it")
    assert not said(resumed, "cached")
    entry = killed.resumed_entry
    assert entry["status"] == "done"
    assert entry["outputs"]["artifact"] == fingerprint(run_dir / "artifact")
    check_safetensors(run_dir / "artifact" / "model.safetensors")
    assert not (run_dir / ".staging" / "quantize").exists()


def test_cached_then_changed_input_reruns(killed: Killed, tiny_llama: Path, onboard_process) -> None:
    run_dir = killed.run_dir
    cached = quantize(onboard_process, tiny_llama, run_dir)
    assert cached.returncode == 0, cached.stderr
    assert said(cached, "quantize: cached, inputs unchanged")
    assert not said(cached, "did not finish")
    assert quantize_entry(run_dir) == killed.resumed_entry
    assert {name: (run_dir / name).read_bytes() for name in OUTPUTS} == killed.resumed_bytes

    changed = quantize(onboard_process, tiny_llama, run_dir, "--num-samples", "3")
    assert changed.returncode == 0, changed.stderr
    assert not said(changed, "cached")
    assert not said(changed, "did not finish")
    entry = quantize_entry(run_dir)
    assert entry["status"] == "done"
    assert entry["key"] != killed.resumed_entry["key"]
    assert entry["inputs"]["quantize"]["calibration"]["num_samples"] == 3
    assert entry["metrics"]["calibration_tokens"] > killed.resumed_entry["metrics"]["calibration_tokens"]
    assert entry["outputs"]["artifact"] == fingerprint(run_dir / "artifact")


def test_quantize_is_deterministic(killed: Killed, tiny_llama: Path, onboard_process, tmp_path: Path) -> None:
    """A fresh run gives the same bytes as the run that was killed and resumed (the second build of
    the same settings is this test's point)."""
    run_dir = tmp_path / "fresh"
    fresh = quantize(onboard_process, tiny_llama, run_dir)
    assert fresh.returncode == 0, fresh.stderr
    assert {name: (run_dir / name).read_bytes() for name in OUTPUTS} == killed.resumed_bytes
    assert quantize_entry(run_dir)["outputs"] == killed.resumed_entry["outputs"]
