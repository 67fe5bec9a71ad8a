"""gpt-oss (`gpt_oss`, 20b and 120b): grouped-query attention with q/k/v/o biases and a learned sink
per head (`layers/sink_attention.py`), sliding-window and full layers alternating per
`layer_types`, YaRN, RMSNorms that multiply their weight in float32 (`UpcastRMSNorm`), and a MoE of
biased, clamped experts in every layer.

The router and experts follow transformers' `GptOssTopKRouter` and `GptOssExperts` op for op:

* routing in the compute dtype: `F.linear` with the router's bias, the top k logits (sorted), their
  softmax in the compute dtype;
* each expert as the checkpoint stores them all (`mlp.experts.gate_up_proj` `[E, H, 2I]`, gate and
  up interleaved column by column, `down_proj` `[E, I, H]`, each with a bias): the product, then
  its bias added in the compute dtype (grouped_mm's `add_`), the gate `min(gate, 7)` times
  `sigmoid(1.702 * gate)`, times `clamp(up, -7, 7) + 1`, then down the same way;
* a quantized artifact holds llm-compressor's linearized experts (`experts.E.{gate,up,down}_proj`,
  biases fused into each linear, the gate's half before the up's): the eager loop's numerics.
"""

from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.layers.moe import run_experts
from onboard.engine.layers.norm import UpcastRMSNorm
from onboard.engine.layers.sink_attention import SinkAttention
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.base import DecoderLayer
from onboard.engine.models.llama import LlamaModel

ALPHA, LIMIT = 1.702, 7.0  # transformers' GptOssExperts constants


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, linearized: bool = False) -> torch.Tensor:
    """`(up + 1) * gate * sigmoid(1.702 * gate)`, clamped, in the order each reference multiplies:
    transformers' experts the gate's two factors first, llm-compressor's linearized ones left to right."""
    gate, up = gate.clamp(max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT)
    if linearized:
        return (up + 1) * gate * torch.sigmoid(gate * ALPHA)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


class StoredExpert(torch.nn.Module):
    """One expert of the stored 3-D tensors, as grouped_mm runs it."""

    def __init__(self, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor, down_bias: torch.Tensor):
        super().__init__()
        self.gate_up, self.gate_up_bias = gate_up, gate_up_bias  # [H, 2I], [2I]
        self.down, self.down_bias = down, down_bias  # [I, H], [H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.matmul(x, self.gate_up).add_(self.gate_up_bias)
        return torch.matmul(clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2]), self.down).add_(self.down_bias)


class LinearizedExpert(torch.nn.Module):
    """One of llm-compressor's linearized experts (a quantized artifact's)."""

    def __init__(self, weights: WeightSource, prefix: str):
        super().__init__()
        self.gate_proj = weights.linear(f"{prefix}.gate_proj")
        self.up_proj = weights.linear(f"{prefix}.up_proj")
        self.down_proj = weights.linear(f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # llm-compressor concatenates the two and splits them again: the activation then reads
        # strided halves, which float32 rounds otherwise than contiguous tensors (`LlamaMLP.halves`)
        gate, up = torch.cat([self.gate_proj.forward(x), self.up_proj.forward(x)], dim=-1).chunk(2, dim=-1)
        return self.down_proj.forward(clamped_swiglu(gate, up, linearized=True))


class GptOssMoE(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = weights.linear(f"{prefix}.router")
        experts = f"{prefix}.experts"
        self.eager = not weights.has(f"{experts}.gate_up_proj")
        if self.eager:
            self.experts = torch.nn.ModuleList(
                LinearizedExpert(weights, f"{experts}.{e}") for e in range(config.num_local_experts)
            )
        else:
            tensors = [weights.tensor(f"{experts}.{n}") for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj")]
            down_bias = weights.tensor(f"{experts}.down_proj_bias")
            self.experts = torch.nn.ModuleList(
                StoredExpert(*(t[e] for t in tensors), down_bias[e]) for e in range(config.num_local_experts)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.forward(x)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(top, dim=1, dtype=top.dtype)
        return run_experts(self.experts, x, weights, indices, self.eager)


class GptOssModel(LlamaModel):
    norm_class = UpcastRMSNorm

    def make_layer(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        attn = SinkAttention(config, weights, f"{prefix}.self_attn", layer_idx)
        return DecoderLayer(config, weights, prefix, attn, GptOssMoE(config, weights, f"{prefix}.mlp"), UpcastRMSNorm)
