"""The residual connection around a decoder sub-layer (attention, MLP): plain addition, or
hyper-connections.

`Residual` is `x + f(x)` over one stream `[T, H]`, what every family but the mHC ones uses.
`HyperConnection` is GLM-5.3-Flash's Manifold-Constrained Hyper-Connections (mHC; transformers'
`Glm5NextTextHyperConnection`): the residual is `hc_mult` parallel streams `[T, hc, H]`.  Per token,
one linear over the RMS-normed flattened streams gives `pre` (how the streams collapse into the
sub-layer's input), `post` (how the sub-layer's output is placed back on each stream) and `comb`
(an `hc x hc` stream mixer projected towards doubly stochastic by `hc_sinkhorn_iters` Sinkhorn
steps); the new streams are `post * f(collapse(streams)) + comb^T @ streams`.  All of that is
float32, as transformers computes it, but the sub-layer's input and the update, which are in the
compute dtype.  The model opens the streams from the embeddings (each a copy) and closes them with
their plain mean before the final norm (`Glm5NextTextHyperHead`).
"""

from collections.abc import Callable
from typing import Any

import torch

from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.linear import EngineLinear

SubLayer = Callable[[torch.Tensor], torch.Tensor]


class Residual(torch.nn.Module):
    """x + f(x)."""

    def forward(self, x: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        return x + sublayer(x)


def open_streams(embeddings: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """`[T, H]` -> `[T, hc, H]`: every stream starts as the token's embedding."""
    return embeddings.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()


def close_streams(streams: torch.Tensor) -> torch.Tensor:
    """`[T, hc, H]` -> `[T, H]`: the streams' mean (GLM-5.3-Flash's head is unweighted)."""
    return streams.mean(dim=1)


def draft_input(states: list[torch.Tensor]) -> torch.Tensor:
    """Aux layers' states as an EAGLE-3 draft reads them, concatenated `[T, len(states) * H]`: a
    hyper-connection family's streams `[T, hc, H]` closed as its head closes them (their mean), so
    the draft's shape and export are every family's."""
    return torch.cat([close_streams(s) if s.dim() == 3 else s for s in states], dim=-1)


class HyperConnection(Residual):
    """mHC around one sub-layer, from the checkpoint's `{prefix}_fn`, `_base` and `_scale`
    (`model.layers.N.hc_attn_*`, `hc_ffn_*`)."""

    def __init__(self, config: Any, weights: WeightSource, prefix: str):
        super().__init__()
        self.hc = config.hc_mult
        self.iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        # base and scale in the compute dtype, as transformers holds them; fn as it uses it (float32),
        # a linear so that fast numerics give it a batch-invariant kernel
        self.fn = EngineLinear(weights.tensor(f"{prefix}_fn").float(), fmt="f32", name=f"{prefix}_fn")
        self.base = torch.nn.Parameter(weights.tensor(f"{prefix}_base"), requires_grad=False)
        self.scale = torch.nn.Parameter(weights.tensor(f"{prefix}_scale"), requires_grad=False)

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre `[T, hc]`, post `[T, hc]`, comb `[T, hc, hc]`), float32, for streams `[T, hc, H]`."""
        hc = self.hc
        flat = streams.flatten(start_dim=1).float()
        flat = flat * torch.rsqrt(flat.float().square().mean(-1, keepdim=True) + self.norm_eps).to(flat.dtype)
        pre_w, post_w, comb_w = self.fn.forward(flat).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], hc, hc) * comb_scale + comb_b.view(hc, hc), dim=-1)
        comb = comb + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    def forward(self, streams: torch.Tensor, sublayer: SubLayer) -> torch.Tensor:
        pre, post, comb = self.mix(streams)
        dtype = streams.dtype
        out = sublayer((pre.unsqueeze(-1) * streams).sum(dim=1).to(dtype))
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed
