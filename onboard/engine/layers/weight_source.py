"""Where layers get their weights (`onboard.engine.weights.CheckpointWeights` implements it)."""

from collections.abc import Sequence
from typing import Protocol

import torch

from onboard.engine.linear import EngineLinear
from onboard.engine.weights import NotFusable


class WeightSource(Protocol):
    def tensor(self, name: str) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...

    def linear(self, prefix: str) -> EngineLinear: ...

    def fused_linear(self, prefixes: Sequence[str]) -> EngineLinear:
        """One linear whose output is the prefixes' outputs concatenated; raises `NotFusable`."""
        ...


def fused_or_split(
    weights: WeightSource, prefixes: Sequence[str]
) -> tuple[EngineLinear | None, list[EngineLinear] | None]:
    """A fused linear over `prefixes` if the source can fuse them, else the separate ones."""
    try:
        return weights.fused_linear(list(prefixes)), None
    except NotFusable:
        return None, [weights.linear(p) for p in prefixes]


def fp32_tensor(weights: WeightSource, name: str) -> torch.Tensor:
    """A tensor transformers holds in float32 whatever the load dtype (`_keep_in_fp32_modules_strict`):
    the stored values, not rounded to the compute dtype first."""
    raw = getattr(weights, "raw", None)
    return (raw(name) if raw is not None else weights.tensor(name)).to(torch.float32)
