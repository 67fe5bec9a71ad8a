"""GLM-4.5 to 4.7 (`glm4_moe`): the llama decoder's grouped-query attention with q/k/v biases,
optional per-head q/k norms and partial rotary (half the head by default; `rope.py`), and
DeepSeek-V3's MoE (`layers/deepseek_moe.py`: sigmoid routing with a correction bias, group-limited
top-k, a shared expert) after the first `first_k_dense_replace` dense layers.

Its MTP layers (`model.layers.{num_hidden_layers}.*`) are not served: the engine never asks for them.
"""

from typing import Any

import torch

from onboard.engine.layers.deepseek_moe import DeepseekMoE
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.llama import LlamaModel


class Glm4MoeModel(LlamaModel):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return LlamaMLP(config, weights, prefix)
        return DeepseekMoE(config, weights, prefix, "eager" if self.quantized else None)
