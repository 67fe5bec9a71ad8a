"""Shared test helpers for quantized artifacts: build one, read its stored tensors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.quantize import modifiers
from onboard.quantize.stage import run_quantize
from onboard.recipes import Quantize
from onboard.workspace import RunDir

REFERENCE_TEXT = (
    "The weather today is cloudy with a chance of rain. def fibonacci(n): return n if n < 2 "
    "else fibonacci(n - 1) + fibonacci(n - 2). The capital of France is Paris."
)
IN_MEMORY_LOGITS = "in_memory_logits.pt"  # beside the run's stage outputs, written by `quantize_into`


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, exactly as stored."""
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
    return found


def stage_entry(root: Path, stage: str) -> dict:
    """The manifest's entry for `stage` of the run directory `root`."""
    return json.loads((root / "manifest.json").read_text())["stages"][stage]


def reference_ids(checkpoint_dir: Path) -> torch.Tensor:
    """REFERENCE_TEXT in the checkpoint's tokens, [1, T]."""
    return torch.tensor([load_tokenizer(inspect_checkpoint(checkpoint_dir))(REFERENCE_TEXT)["input_ids"]])


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits[0].float()


def quantize_into(root: Path, checkpoint_dir: Path, settings: Quantize) -> Path:
    """Run the real quantize stage into the run directory `root`; return its artifact. The stage's
    own call of the modifiers is watched: the logits on REFERENCE_TEXT of the model it quantized,
    before it was saved, go to `root / IN_MEMORY_LOGITS` (the reference a reload must reproduce)."""
    ids = reference_ids(checkpoint_dir)
    apply = modifiers.apply

    def apply_and_keep(model, *args, **kwargs) -> None:
        apply(model, *args, **kwargs)
        torch.save(logits_of(model, ids), root / IN_MEMORY_LOGITS)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modifiers, "apply", apply_and_keep)
        with RunDir(root) as run:
            entry = run_quantize(run, inspect_checkpoint(checkpoint_dir), settings, None)
    assert entry["status"] == "done"
    return root / "artifact"
