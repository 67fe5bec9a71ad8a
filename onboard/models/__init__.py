"""Model loading: checkpoint checks, GGUF conversion, the embedded demo model."""

from typing import TYPE_CHECKING

# Loaded on first use: importing the package (say, for `models.mtp`'s header reads in `onboard
# gate`) must not import transformers, which alone costs seconds.
_LAZY = {
    "Checkpoint": "onboard.models.checkpoint",
    "inspect_checkpoint": "onboard.models.checkpoint",
    "load_model": "onboard.models.loading",
    "load_tokenizer": "onboard.models.loading",
    "resolve_model": "onboard.models.loading",
}

if TYPE_CHECKING:
    from onboard.models.checkpoint import Checkpoint, inspect_checkpoint
    from onboard.models.loading import load_model, load_tokenizer, resolve_model

__all__ = ["Checkpoint", "inspect_checkpoint", "load_model", "load_tokenizer", "resolve_model"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'onboard.models' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
