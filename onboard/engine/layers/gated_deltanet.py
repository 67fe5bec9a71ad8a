"""Gated DeltaNet linear attention (Qwen3.5, and Qwen3-Next's fused projections in
`models/qwen3_next.py`), over a per-sequence state.

Per token: `in_proj_qkv` feeds a depthwise causal conv1d (SiLU) whose last `kernel` inputs are
the sequence's conv state; q and k are L2-normalised per head; beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias) gate the delta rule's update of an fp32 recurrent state
`[value heads, key dim, value dim]`; the output is RMS-normed, gated by silu(z) and projected.
How each sequence runs (prefill, continued chunk, decode, verification) is `linear_attention.py`.

The rules and the conv are transformers' own torch functions, unwrapped from the decorator that
would swap in flash-linear-attention where it is installed: parity with transformers is proven
against this torch path, whatever kernels a machine has (with fla installed, transformers itself
would take another path and round differently).
"""

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

from onboard.engine.layers.linear_attention import LinearAttention
from onboard.engine.layers.norm import GatedRMSNorm
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.state_cache import StateSpec


def deltanet_state_specs(config: Any, dtype: torch.dtype) -> list[StateSpec]:
    """The conv window (compute dtype) and the recurrent state (fp32) of every linear layer."""
    layers = tuple(i for i, kind in enumerate(config.layer_types) if kind == "linear_attention")
    key_dim = config.linear_key_head_dim * config.linear_num_key_heads
    conv_dim = 2 * key_dim + config.linear_value_head_dim * config.linear_num_value_heads
    recurrent = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    return [
        StateSpec("conv", (conv_dim, config.linear_conv_kernel_dim), dtype, layers),
        StateSpec("recurrent", recurrent, torch.float32, layers),
    ]


class GatedDeltaNet(LinearAttention):
    chunk_rule = staticmethod(inspect.unwrap(reference.torch_chunk_gated_delta_rule))
    recurrent_rule = staticmethod(inspect.unwrap(reference.torch_recurrent_gated_delta_rule))
    conv_prefill = staticmethod(inspect.unwrap(reference.causal_conv1d_fn))
    conv_step = staticmethod(inspect.unwrap(reference.causal_conv1d_update))

    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        conv_weight = weights.tensor(f"{prefix}.conv1d.weight").squeeze(1)
        super().__init__(layer_idx, config.linear_conv_kernel_dim, config.hidden_act, conv_weight)
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.load_projections(weights, prefix)
        self.dt_bias = torch.nn.Parameter(weights.tensor(f"{prefix}.dt_bias"), requires_grad=False)
        self.A_log = torch.nn.Parameter(weights.tensor(f"{prefix}.A_log"), requires_grad=False)
        self.norm = GatedRMSNorm(weights.tensor(f"{prefix}.norm.weight"), config.rms_norm_eps)
        self.out_proj = weights.linear(f"{prefix}.out_proj")

    def load_projections(self, weights: WeightSource, prefix: str) -> None:
        self.in_proj_qkv = weights.linear(f"{prefix}.in_proj_qkv")
        self.in_proj_z = weights.linear(f"{prefix}.in_proj_z")
        self.in_proj_b = weights.linear(f"{prefix}.in_proj_b")
        self.in_proj_a = weights.linear(f"{prefix}.in_proj_a")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.in_proj_qkv.forward(x), (self.in_proj_b.forward(x), self.in_proj_a.forward(x))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj_z.forward(x)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, n = mixed.shape[:2]
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, n, -1, self.head_k_dim)
        key = key.reshape(batch, n, -1, self.head_k_dim)
        value = value.reshape(batch, n, -1, self.head_v_dim)
        if self.num_v_heads // self.num_k_heads > 1:
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        return query, key, value

    def finish(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        z = self.output_gate(x)
        out = self.norm.forward(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj.forward(out.reshape(x.shape[0], self.value_dim))
