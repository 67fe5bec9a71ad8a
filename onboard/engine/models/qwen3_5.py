"""Qwen3.5's text models (`qwen3_5_text`, and `qwen3_5_moe_text` with its MoE): Gated DeltaNet
layers with a per-sequence state (`layers/gated_deltanet.py`) interleaved, per
`config.layer_types`, with output-gated attention layers (`layers/gated_attention.py`, partial
RoPE) that cache K and V per token; zero-centred RMSNorms everywhere; llama's gated MLP, or
Qwen3-MoE's experts with a sigmoid-gated shared expert.

The per-token cache holds the full-attention layers only; the state pool holds the linear ones.
Text positions make transformers' interleaved MRoPE plain partial RoPE (every section reads the
same position), which is what the engine's RoPE computes.
"""

from typing import Any

import torch

from onboard.engine.batch import ForwardBatch
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVLayout, KVTensorSpec
from onboard.engine.layers.gated_attention import GatedAttention
from onboard.engine.layers.gated_deltanet import GatedDeltaNet, deltanet_state_specs
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.norm import ZeroCenteredRMSNorm
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.base import DecoderLayer, DecoderModel
from onboard.engine.models.qwen3_moe import Qwen3MoeSparseBlock
from onboard.engine.rope import RotaryEmbedding, head_dim_of
from onboard.engine.state_cache import StateLayout, state_seqs


def full_attention_layers(config: Any) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")


class Qwen3_5Model(DecoderModel):
    norm_class = ZeroCenteredRMSNorm

    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        super().__init__(config, weights, layer_ids)
        self.rotary = RotaryEmbedding(config, self.dtype, self.device)

    def make_layer(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        if config.layer_types[layer_idx] == "linear_attention":
            mixer = self.make_linear_attention(config, weights, f"{prefix}.linear_attn", layer_idx)
        else:
            mixer = GatedAttention(config, weights, f"{prefix}.self_attn", layer_idx)
        mlp = self.make_mlp(config, weights, f"{prefix}.mlp", layer_idx)
        return DecoderLayer(config, weights, prefix, mixer, mlp, norm=ZeroCenteredRMSNorm)

    def make_linear_attention(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> GatedDeltaNet:
        return GatedDeltaNet(config, weights, prefix, layer_idx)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        return LlamaMLP(config, weights, prefix)

    @classmethod
    def layout_for(cls, config: Any, dtype: torch.dtype) -> KVLayout:
        shape, layers = (config.num_key_value_heads, head_dim_of(config)), full_attention_layers(config)
        return KVLayout((KVTensorSpec("k", shape, layers), KVTensorSpec("v", shape, layers)), dtype)

    @classmethod
    def state_layout_for(cls, config: Any, dtype: torch.dtype) -> StateLayout:
        return StateLayout(tuple(deltanet_state_specs(config, dtype)))

    def prepare(self, batch: ForwardBatch, ctx: StepContext) -> None:
        cos, sin = self.rotary(ctx.positions, max_position=max(batch.context_lens, default=1) - 1)
        ctx.tables["cos"], ctx.tables["sin"] = cos, sin
        ctx.tables["state_seqs"] = state_seqs(batch.query_lens, batch.context_lens, batch.state_slots, batch.decoding)


class Qwen3_5MoeSparseBlock(Qwen3MoeSparseBlock):
    """Qwen3-MoE's routing (softmax in float32, top-k renormalised) and experts, plus a shared
    expert scaled by sigmoid(`shared_expert_gate`), as transformers' `Qwen3_5MoeSparseMoeBlock`."""

    def __init__(self, config: Any, weights: WeightSource, prefix: str, eager: bool):
        super().__init__(config, weights, prefix, eager)
        self.shared_expert = LlamaMLP(config, weights, f"{prefix}.shared_expert")
        self.shared_expert_gate = weights.linear(f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert.forward(x)
        routed = super().forward(x)
        return routed + torch.sigmoid(self.shared_expert_gate.forward(x)) * shared


class Qwen3_5MoeModel(Qwen3_5Model):
    """Qwen3.5-MoE's text model: `Qwen3_5Model` with a sparse MoE in every layer."""

    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        return Qwen3_5MoeSparseBlock(config, weights, prefix, eager=self.quantized)
