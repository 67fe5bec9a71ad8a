"""The engine's shared per-step vocabulary: what a model's forward gets and gives back."""

from dataclasses import dataclass, field
from typing import Any

import torch

from onboard.engine.attention import AttentionBackend, AttentionMetadata
from onboard.engine.kv_cache import KVCache
from onboard.engine.state_cache import StateCache


@dataclass
class StepContext:
    """One forward step, shared by all layers: the cache, the backend and its metadata, and the
    per-step tables a model family computes once (RoPE cos/sin, keyed by the family; the state
    layers' sequences and the draft positions' states they keep)."""

    cache: KVCache
    backend: AttentionBackend
    attn: AttentionMetadata
    positions: torch.Tensor  # [T] on the model's device
    aux_layers: tuple[int, ...] = ()
    numerics: str = "exact"  # EngineConfig.numerics
    tables: dict[str, Any] = field(default_factory=dict)
    # When a dict: layers record what a parity check compares (DSA: the selected key positions).
    trace: dict[int, list] | None = None
    state: StateCache | None = None  # per-sequence state (linear attention), where the model has one


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, H] final-normed hidden states of the step's tokens
    # the inputs of decoder layers `aux_layers`, each [T, H] ([T, hc, H]: hyper-connection streams)
    aux_hidden_states: list[torch.Tensor]
