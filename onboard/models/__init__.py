"""Model loading: checkpoint checks, GGUF conversion, the embedded demo model."""

from onboard.models.checkpoint import Checkpoint, inspect_checkpoint
from onboard.models.loading import load_model, load_tokenizer, resolve_model

__all__ = ["Checkpoint", "inspect_checkpoint", "load_model", "load_tokenizer", "resolve_model"]
