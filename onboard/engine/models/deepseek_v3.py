"""The DeepSeek-V3 family: DeepSeek-V3 (and V2-style configs), DeepSeek-V3.2, GLM-5.

Each layer is MLA (`layers/mla.py`) with, on V3.2 and GLM-5, a DSA indexer (`layers/dsa.py`;
GLM-5's "shared" layers reuse the previous full layer's selection), and a dense MLP for the first
`first_k_dense_replace` layers (or per `mlp_layer_types`), DeepSeek MoE after
(`layers/deepseek_moe.py`).  What differs between the three is read from the config:

* RoPE layout: interleaved on the MLA part when `rope_interleave` (V3; always on V3.2 and GLM-5);
  the indexer's RoPE is half-split on V3.2 and interleaved on GLM-5;
* the indexer: present when the config has `index_topk`; `indexer_types` (GLM-5) says which
  layers run it;
* the rope dim is `qk_rope_head_dim` (transformers points `config.head_dim` at it).

The cache holds the latent row per token and layer, plus the indexer keys on indexer layers.
Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`, DeepSeek's MTP head) are not
served: the weights are skipped with one notice.  Quantized MoE artifacts run the routed experts
with the eager loop's numerics, as the reference `onboard.models.load_model` runs them.
"""

from typing import Any

import torch

from onboard.console import console
from onboard.engine.batch import ForwardBatch
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVLayout, KVTensorSpec
from onboard.engine.layers.deepseek_moe import DeepseekMoE
from onboard.engine.layers.dsa import Indexer, is_dsa, runs_indexer
from onboard.engine.layers.mla import MLAttention, mla_kv_tensors
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.base import DecoderLayer, DecoderModel
from onboard.engine.rope import RotaryEmbedding
from onboard.errors import OnboardError

_MODEL_TYPES_WITH_INTERLEAVED_INDEXER = {"glm_moe_dsa"}


def _is_sparse_mlp(config: Any, layer_idx: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types is not None:
        return types[layer_idx] == "sparse"
    return layer_idx >= config.first_k_dense_replace


def _mla_interleaved(config: Any) -> bool:
    return bool(getattr(config, "rope_interleave", None) or is_dsa(config))


def mtp_layer_names(names: list[str], num_hidden_layers: int) -> list[str]:
    prefix = f"model.layers.{num_hidden_layers}."
    return [n for n in names if n.startswith(prefix)]


class DeepseekV3Model(DecoderModel):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        names = weights.names() if hasattr(weights, "names") else []
        mtp = mtp_layer_names(names, config.num_hidden_layers)
        if mtp:
            console.print(
                f"skipping {len(mtp)} multi-token-prediction tensors (model.layers.{config.num_hidden_layers}.*)"
            )
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)
        self.rotary = RotaryEmbedding(config, self.dtype, self.device)

    def make_layer(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        indexer = None
        if is_dsa(config) and config.q_lora_rank is None:
            raise OnboardError("a DSA indexer reads the query latent: this config has index_topk but no q_lora_rank")
        if runs_indexer(config, layer_idx):
            interleaved = config.model_type in _MODEL_TYPES_WITH_INTERLEAVED_INDEXER
            indexer = Indexer(config, weights, f"{prefix}.self_attn.indexer", layer_idx, interleaved)
        shares = is_dsa(config) and indexer is None
        attn = MLAttention(config, weights, f"{prefix}.self_attn", layer_idx, _mla_interleaved(config), indexer, shares)
        if _is_sparse_mlp(config, layer_idx):
            mlp = DeepseekMoE(config, weights, f"{prefix}.mlp", "eager" if self.quantized else None)
        else:
            mlp = LlamaMLP(config, weights, f"{prefix}.mlp")
        return DecoderLayer(config, weights, prefix, attn, mlp)

    @classmethod
    def layout_for(cls, config: Any, dtype: torch.dtype) -> KVLayout:
        tensors = mla_kv_tensors(config)
        indexer_layers = tuple(i for i in range(config.num_hidden_layers) if runs_indexer(config, i))
        if indexer_layers:
            tensors.append(KVTensorSpec("index_k", (config.index_head_dim,), indexer_layers))
        return KVLayout(tuple(tensors), dtype)

    def prepare(self, batch: ForwardBatch, ctx: StepContext) -> None:
        cos, sin = self.rotary(ctx.positions, max_position=max(batch.context_lens, default=1) - 1)
        ctx.tables["cos"], ctx.tables["sin"] = cos, sin
