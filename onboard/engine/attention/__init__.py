"""Attention backends behind one interface (`base.AttentionBackend`), chosen once per engine."""

import torch

from onboard.engine.attention.base import AttentionBackend
from onboard.engine.attention.cpu import CpuBackend
from onboard.engine.attention.fast import FastBackend
from onboard.engine.attention.metadata import AttentionMetadata, PrefillSeq
from onboard.engine.attention.sdpa import SdpaBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    CpuBackend.name: CpuBackend,
    SdpaBackend.name: SdpaBackend,
    FastBackend.name: FastBackend,
}


def attention_backend(device: torch.device | str, name: str | None = None, numerics: str = "exact") -> AttentionBackend:
    """The backend `name`, or the default: in fast numerics the folded one (`fast.py`); in exact
    numerics per-row on the CPU, padded SDPA elsewhere."""
    device = torch.device(device)
    if name is None:
        name = "fast" if numerics == "fast" else "cpu" if device.type == "cpu" else "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name](device)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "PrefillSeq", "attention_backend"]
