"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next), over a per-sequence state.

Per token: `in_proj_qkv` feeds a depthwise causal conv1d (SiLU) whose last `kernel` inputs are
the sequence's conv state; q and k are L2-normalised per head; beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias) gate the delta rule's update of an fp32 recurrent state
`[value heads, key dim, value dim]`; the output is RMS-normed, gated by silu(z) and projected.

Each sequence runs as transformers runs it with a cache: its first step (a prompt, or its first
chunk) by the chunked delta rule from a zero state; a later chunk by the chunked rule from the
stored state, its conv over the stored window and the new inputs; one decode token by the
recurrent rule and the conv's one-step update.  A decoding sequence verifying draft tokens
advances token by token as that many decode steps would, and keeps each position's state so a
rejection can roll back (`state_cache.py`).

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

from onboard.engine.context import StepContext
from onboard.engine.layers.norm import GatedRMSNorm
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.state_cache import StateSpec

chunk_rule = inspect.unwrap(reference.torch_chunk_gated_delta_rule)
recurrent_rule = inspect.unwrap(reference.torch_recurrent_gated_delta_rule)
conv_prefill = inspect.unwrap(reference.causal_conv1d_fn)
conv_step = inspect.unwrap(reference.causal_conv1d_update)


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


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.kernel = config.linear_conv_kernel_dim
        self.activation = config.hidden_act
        self.in_proj_qkv = weights.linear(f"{prefix}.in_proj_qkv")
        self.in_proj_z = weights.linear(f"{prefix}.in_proj_z")
        self.in_proj_b = weights.linear(f"{prefix}.in_proj_b")
        self.in_proj_a = weights.linear(f"{prefix}.in_proj_a")
        self.conv_weight = torch.nn.Parameter(weights.tensor(f"{prefix}.conv1d.weight").squeeze(1), requires_grad=False)
        self.dt_bias = torch.nn.Parameter(weights.tensor(f"{prefix}.dt_bias"), requires_grad=False)
        self.A_log = torch.nn.Parameter(weights.tensor(f"{prefix}.A_log"), requires_grad=False)
        self.norm = GatedRMSNorm(weights.tensor(f"{prefix}.norm.weight"), config.rms_norm_eps)
        self.out_proj = weights.linear(f"{prefix}.out_proj")

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        qkv, z = self.in_proj_qkv.forward(x), self.in_proj_z.forward(x)
        b, a = self.in_proj_b.forward(x), self.in_proj_a.forward(x)
        conv_states = ctx.state.get("conv", self.layer_idx)
        states = ctx.state.get("recurrent", self.layer_idx)
        checkpoints = ctx.tables.get("state_checkpoints")
        seqs = ctx.tables["state_seqs"]
        decoding = [seq for seq in seqs if seq.continues and seq.end - seq.start == 1]
        if len(decoding) == len(seqs) > 1:  # a decode step: every sequence's token in one batch
            core = self._decode_batch(qkv, b, a, conv_states, states, [seq.slot for seq in seqs])
            out = self.norm.forward(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
            return self.out_proj.forward(out.reshape(x.shape[0], self.value_dim))
        parts = []
        for seq in seqs:
            rows = slice(seq.start, seq.end)
            conv_state, state = conv_states[seq.slot : seq.slot + 1], states[seq.slot : seq.slot + 1]
            if seq.verifying:  # as that many decode steps, each position's state kept
                outs, kept = [], []
                for row in range(seq.start, seq.end):
                    one = slice(row, row + 1)
                    outs.append(self._decode(qkv[one], b[one], a[one], conv_state, state))
                    kept.append((conv_state.clone(), state.clone()))
                checkpoints.setdefault(seq.index, {})[self.layer_idx] = kept
                parts.append(torch.cat(outs))
            elif seq.continues and seq.end - seq.start == 1:
                parts.append(self._decode(qkv[rows], b[rows], a[rows], conv_state, state))
            else:
                parts.append(self._prefill(qkv[rows], b[rows], a[rows], conv_state, state, seq.continues))
        core = torch.cat(parts) if len(parts) > 1 else parts[0]  # [T, value heads, value dim]
        out = self.norm.forward(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj.forward(out.reshape(x.shape[0], self.value_dim))

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return b.sigmoid(), -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _heads(self, mixed: torch.Tensor, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[batch, n, conv dim]` after the conv -> q, k `[batch, n, value heads, key dim]`, v."""
        n = mixed.shape[1]
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, n, -1, self.head_k_dim)
        key = key.reshape(batch, n, -1, self.head_k_dim)
        value = value.reshape(batch, n, -1, self.head_v_dim)
        if self.num_v_heads // self.num_k_heads > 1:
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        return query, key, value

    def _prefill(self, qkv, b, a, conv_state, state, continues: bool) -> torch.Tensor:
        n = qkv.shape[0]
        mixed = qkv.T[None]  # [1, conv dim, n]
        if continues:
            window = torch.cat([conv_state, mixed], dim=-1)
        else:  # transformers pads a first step shorter than the kernel before storing its window
            window = F.pad(mixed, (self.kernel - n, 0)) if n < self.kernel else mixed
        conv_state.copy_(window[..., -self.kernel :])
        mixed = conv_prefill(window, self.conv_weight, None, activation=self.activation)[:, :, -n:]
        query, key, value = self._heads(mixed.transpose(1, 2))
        beta, g = self._gates(b[None], a[None])
        out, final = chunk_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=state if continues else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        state.copy_(final)
        return out[0]

    def _decode_batch(self, qkv, b, a, conv_states, states, slots: list[int]) -> torch.Tensor:
        """One decode token of each of B sequences, batched: the conv and the rule compute each
        batch row on its own (no reduction across rows), so a row's bits are its lone decode's."""
        index = torch.tensor(slots, dtype=torch.long, device=qkv.device)
        conv_state, state = conv_states.index_select(0, index), states.index_select(0, index)
        out, final = self._recurrent(qkv[:, :, None], b[:, None], a[:, None], conv_state, state)
        conv_states.index_copy_(0, index, conv_state)
        states.index_copy_(0, index, final)
        return out[:, 0]

    def _decode(self, qkv, b, a, conv_state, state) -> torch.Tensor:
        out, final = self._recurrent(qkv.T[None], b[None], a[None], conv_state, state)
        state.copy_(final)
        return out[0]

    def _recurrent(self, columns, b, a, conv_state, state) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per batch row (`columns` `[B, conv dim, 1]`): the conv's step (updating
        `conv_state` in place) and the recurrent rule from `state`; (out, the new state)."""
        mixed = conv_step(columns, conv_state, self.conv_weight, None, self.activation)
        query, key, value = self._heads(mixed.transpose(1, 2), batch=columns.shape[0])
        beta, g = self._gates(b, a)
        return recurrent_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
