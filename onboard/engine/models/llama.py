"""The llama family as the engine runs it: llama, mistral, qwen2 and qwen3 in one class.

Differences between the families are read from the config and the checkpoint, not the name:
q/k/v (qwen2) and o/mlp biases are whatever biases the checkpoint holds; qwen3's q/k norms are
used when present (`layers/mha.py`); tied embeddings make lm_head the embedding matrix; sliding
windows come from the config.  Subclasses change the MLP of a layer by overriding `make_mlp`.
"""

from typing import Any

import torch

from onboard.engine.batch import ForwardBatch
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVLayout
from onboard.engine.layers.mha import LlamaAttention, mha_kv_tensors
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.base import DecoderLayer, DecoderModel
from onboard.engine.rope import RotaryEmbedding


class LlamaModel(DecoderModel):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        super().__init__(config, weights, layer_ids)
        self.rotary = RotaryEmbedding(config, self.dtype, self.device)

    def make_layer(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        attn = LlamaAttention(config, weights, f"{prefix}.self_attn", layer_idx)
        return DecoderLayer(config, weights, prefix, attn, self.make_mlp(config, weights, f"{prefix}.mlp", layer_idx))

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        return LlamaMLP(config, weights, prefix)

    @classmethod
    def layout_for(cls, config: Any, dtype: torch.dtype) -> KVLayout:
        return KVLayout(tuple(mha_kv_tensors(config)), dtype)

    def prepare(self, batch: ForwardBatch, ctx: StepContext) -> None:
        cos, sin = self.rotary(ctx.positions, max_position=max(batch.context_lens, default=1) - 1)
        ctx.tables["cos"], ctx.tables["sin"] = cos, sin
