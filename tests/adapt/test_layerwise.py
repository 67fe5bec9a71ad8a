"""The layerwise rule's error accumulator: an empty call (a routed expert no token chose) adds
nothing; a real one is measured against the output's rounding step."""

import torch

from onboard.adapt.layerwise import _Error


def test_an_expert_no_token_chose_adds_nothing() -> None:
    error = _Error("model.layers.1.mlp.experts.3.down_proj")
    error.add(torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(0, 64, dtype=torch.bfloat16))
    assert error.count == 0 and error.ratio == 0.0 and error.max_abs == 0.0
    theirs = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    error.add(theirs * 1.05, theirs)
    assert error.count == theirs.numel() and error.ratio > 1 and error.max_abs > 0
