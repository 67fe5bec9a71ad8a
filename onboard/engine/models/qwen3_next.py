"""Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5's text model before it split its projections.

Its Gated DeltaNet stores two fused linears, `in_proj_qkvz` and `in_proj_ba`, whose outputs are
grouped per key head (each group: that head's q and k, then its value heads' v and z; b then a),
where Qwen3.5 stores `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b`, `in_proj_a`.
The engine computes the fused products as stored (a quantized artifact keeps them as one linear,
as llm-compressor quantized them) and regroups the outputs as transformers'
`fix_query_key_value_ordering` does; everything after is Qwen3.5's. Its MLP is Qwen3-MoE's rule:
sparse where `decoder_sparse_step` and `mlp_only_layers` say, with Qwen3.5-MoE's gated shared expert.
"""

from typing import Any

import torch

from onboard.engine.layers.gated_deltanet import GatedDeltaNet
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.qwen3_5 import Qwen3_5Model, Qwen3_5MoeSparseBlock
from onboard.engine.models.qwen3_moe import is_sparse_layer


class FusedGatedDeltaNet(GatedDeltaNet):
    def load_projections(self, weights: WeightSource, prefix: str) -> None:
        self.in_proj_qkvz = weights.linear(f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = weights.linear(f"{prefix}.in_proj_ba")
        self._z: torch.Tensor | None = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        t, groups, per = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz.forward(x).view(t, groups, 2 * self.head_k_dim + 2 * per * self.head_v_dim)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim], -1)
        b, a = self.in_proj_ba.forward(x).view(t, groups, 2 * per).split([per, per], -1)
        # The step's output gate, read back by `output_gate` in the same forward (one product, not two).
        self._z = z.reshape(t, self.value_dim)
        mixed = torch.cat([q.reshape(t, self.key_dim), k.reshape(t, self.key_dim), v.reshape(t, self.value_dim)], -1)
        return mixed, (b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        z, self._z = self._z, None
        return z


class Qwen3NextModel(Qwen3_5Model):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)

    def make_linear_attention(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> GatedDeltaNet:
        return FusedGatedDeltaNet(config, weights, prefix, layer_idx)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, weights, prefix)
        return Qwen3_5MoeSparseBlock(config, weights, prefix, eager=self.quantized)
