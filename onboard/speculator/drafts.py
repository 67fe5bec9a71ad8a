"""The draft a `--speculator` value names: an EAGLE-3 export directory, or `mtp` (the served
checkpoint's own MTP layers, `mtp_draft.py`)."""

from pathlib import Path

import torch

from onboard.deploy.artifact import is_mtp


def load_draft(speculator: Path, model_dir: Path, engine) -> tuple[torch.nn.Module, int]:
    """The draft for `engine` (serving `model_dir`) and its default tokens per step: the export's
    K, or one per MTP layer."""
    if is_mtp(speculator):
        from onboard.speculator.mtp_draft import load_mtp_draft

        target = engine.target_tensors()
        draft = load_mtp_draft(model_dir, target["embed_tokens"], target["lm_head"], engine.dtype)
        return draft, draft.num_layers
    from onboard.speculator.export import load_speculator, speculative_tokens

    return load_speculator(speculator), speculative_tokens(speculator)
