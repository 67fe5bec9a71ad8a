"""Attention backends behind one interface (`base.AttentionBackend`), chosen once per engine."""

import torch

from onboard.engine.attention.base import AttentionBackend
from onboard.engine.attention.cpu import CpuBackend
from onboard.engine.attention.fast import FastBackend
from onboard.engine.attention.fast_batched import FastBatchedBackend
from onboard.engine.attention.metadata import AttentionMetadata, PrefillSeq
from onboard.engine.attention.sdpa import SdpaBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    CpuBackend.name: CpuBackend,
    SdpaBackend.name: SdpaBackend,
    FastBackend.name: FastBackend,
    FastBatchedBackend.name: FastBatchedBackend,
}


def attention_backend(
    device: torch.device | str, name: str | None = None, numerics: str = "exact", batch_invariant: bool = True
) -> AttentionBackend:
    """The backend `name`, or the default: in fast numerics the folded one (`fast.py`), or its
    one-call form (`fast_batched.py`) without batch invariance; in exact numerics per-row on the
    CPU, padded SDPA elsewhere."""
    device = torch.device(device)
    if name is None:
        if numerics == "fast":
            name = "fast" if batch_invariant else "fast_batched"
        else:
            name = "cpu" if device.type == "cpu" else "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name](device)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "PrefillSeq", "attention_backend"]
