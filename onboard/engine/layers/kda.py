"""Kimi Delta Attention (KDA: GLM-5.3-Flash's linear attention, Kimi Linear's), over a per-sequence state.

Per token: q, k and v projections (side by side) feed a depthwise causal conv1d (SiLU) whose last
`kernel` inputs are the sequence's conv state; a per-channel forget gate g from the low-rank
`f_b_proj(f_a_proj(x))` plus `dt_bias`, scaled by exp(A_log): `lower_bound * sigmoid(exp(A_log) * g)`
under the safe lower bound, `-exp(A_log) * softplus(g)` without it; beta = sigmoid(b_proj(x)).
The delta rule (q and k L2-normalised in float32) updates an fp32 state `[heads, head dim, head dim]`;
the output is RMS-normed in float32, gated by sigmoid of the low-rank `g_b_proj(g_a_proj(x))`, and
projected.  How each sequence runs (prefill, continued chunk, decode, verification) is
`linear_attention.py`: the chunked rule for several tokens, the recurrent rule for one (transformers'
`seq_len == 1` choice).

The rules and the conv are transformers' own torch functions (`modeling_glm5_next`), unwrapped from
the decorator that would swap in flash-linear-attention or causal-conv1d where installed: parity
with transformers is proven against this torch path, whatever kernels a machine has.  The conv
weight, `dt_bias` and `A_log` are float32 as transformers keeps them (`_keep_in_fp32_modules_strict`):
the conv runs in float32 and casts back.  The checkpoint stores the conv per projection
(`q_conv1d`, `k_conv1d`, `v_conv1d`), which transformers concatenates into one on load.
"""

import inspect
from typing import Any

import torch
from transformers.models.glm5_next import modeling_glm5_next as reference

from onboard.engine.layers.linear_attention import LinearAttention
from onboard.engine.layers.norm import SigmoidGatedRMSNorm
from onboard.engine.layers.weight_source import WeightSource, fp32_tensor, fused_or_split
from onboard.engine.state_cache import StateSpec


def kda_layers(config: Any) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config.layer_types) if kind == "linear_attention")


def kda_state_specs(config: Any, dtype: torch.dtype) -> list[StateSpec]:
    """The conv window over q, k and v (compute dtype) and the recurrent state (fp32) of every KDA layer."""
    heads, dim = config.linear_num_heads, config.linear_head_dim
    return [
        StateSpec("conv", (3 * heads * dim, config.linear_conv_kernel_dim), dtype, kda_layers(config)),
        StateSpec("recurrent", (heads, dim, dim), torch.float32, kda_layers(config)),
    ]


class KimiDeltaAttention(LinearAttention):
    chunk_rule = staticmethod(inspect.unwrap(reference.chunk_kimi_delta_attention))
    recurrent_rule = staticmethod(inspect.unwrap(reference.recurrent_kimi_delta_attention))
    conv_prefill = staticmethod(inspect.unwrap(reference.causal_conv1d_fn))
    conv_step = staticmethod(inspect.unwrap(reference.causal_conv1d_update))

    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        convs = [fp32_tensor(weights, f"{prefix}.{p}_conv1d.weight") for p in "qkv"]
        super().__init__(layer_idx, config.linear_conv_kernel_dim, config.hidden_act, torch.cat(convs).squeeze(1))
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.qkv_proj, split = fused_or_split(weights, [f"{prefix}.{p}_proj" for p in "qkv"])
        self.q_proj, self.k_proj, self.v_proj = split if split is not None else (None, None, None)
        self.f_a_proj = weights.linear(f"{prefix}.f_a_proj")
        self.f_b_proj = weights.linear(f"{prefix}.f_b_proj")
        self.dt_bias = torch.nn.Parameter(fp32_tensor(weights, f"{prefix}.dt_bias"), requires_grad=False)
        self.A_log = torch.nn.Parameter(fp32_tensor(weights, f"{prefix}.A_log"), requires_grad=False)
        self.lower_bound = config.linear_lower_bound
        self.b_proj = weights.linear(f"{prefix}.b_proj")
        self.g_a_proj = weights.linear(f"{prefix}.g_a_proj")
        self.g_b_proj = weights.linear(f"{prefix}.g_b_proj")
        self.o_norm = SigmoidGatedRMSNorm(weights.tensor(f"{prefix}.o_norm.weight"), config.rms_norm_eps)
        self.o_proj = weights.linear(f"{prefix}.o_proj")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if self.qkv_proj is not None:
            mixed = self.qkv_proj.forward(x)
        else:
            mixed = torch.cat([self.q_proj.forward(x), self.k_proj.forward(x), self.v_proj.forward(x)], dim=-1)
        return mixed, (self.f_b_proj.forward(self.f_a_proj.forward(x)), self.b_proj.forward(x))

    def gates(self, forget: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' `Glm5NextTextForgetGate` on `[B, n, heads * head dim]`, and beta."""
        g = (forget.float() + self.dt_bias.view(1, 1, -1)).view(*forget.shape[:2], -1, self.head_dim)
        decay_rate = torch.exp(self.A_log.view(1, 1, self.num_heads, 1))
        if self.lower_bound is not None:
            g = self.lower_bound * torch.sigmoid(decay_rate * g)
        else:
            g = -decay_rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return torch.sigmoid(b), g

    def split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, n = mixed.shape[:2]
        parts = torch.split(mixed, [self.qkv_dim] * 3, dim=-1)
        query, key, value = (part.reshape(batch, n, -1, self.head_dim) for part in parts)
        return query, key, value

    def finish(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = self.g_b_proj.forward(self.g_a_proj.forward(x)).view(x.shape[0], -1, self.head_dim)
        return self.o_proj.forward(self.o_norm.forward(core, gate).reshape(x.shape[0], self.qkv_dim))
