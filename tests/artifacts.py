"""Shared test helpers for quantized artifacts: build one, read its stored tensors."""

from pathlib import Path

import torch
from safetensors import safe_open

from onboard.models import inspect_checkpoint
from onboard.quantize.stage import run_quantize
from onboard.recipes import Quantize
from onboard.workspace import RunDir


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, exactly as stored."""
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    return found


def quantize_into(root: Path, checkpoint_dir: Path, settings: Quantize) -> Path:
    """Run the real quantize stage into the run directory `root`; return its artifact."""
    with RunDir(root) as run:
        entry = run_quantize(run, inspect_checkpoint(checkpoint_dir), settings, None)
    assert entry["status"] == "done"
    return root / "artifact"
