"""GLM-5.3-Flash's text model (`glm5_next_text`, served from its VLM release
`Glm5NextForConditionalGeneration`; transformers' `Glm5NextTextModel`).

Per `config.layer_types`, KDA linear attention (`layers/kda.py`) over the per-sequence state
pool, or NoPE MLA (`qk_rope_head_dim = 0`) with a DSA indexer over pooled keys
(`layers/dsa_pool.py`; `indexer_types` "shared" layers reuse the previous layer's selection).
Per `mlp_layer_types`, a dense MLP or DeepSeek's MoE (sigmoid routing with the correction bias,
group-limited), both with clamped SwiGLU (`swiglu_limit`).  The residual is `hc_mult` streams
joined by hyper-connections (`layers/residual.py`), opened from the embeddings and closed by their
mean before the final norm.  The MLA latent norms use `rms_norm_eps` (DeepSeek's use 1e-6).

The per-token cache holds the latent row on the DSA layers and the indexer's (key, gate) rows on
those that run an indexer; the state pool holds the KDA layers' conv windows and fp32 states.
The MTP layer (`model.layers.{num_hidden_layers}.*`) is not part of the main model: its weights
are skipped with one notice.
"""

from typing import Any

import torch

from onboard.console import console
from onboard.engine.batch import ForwardBatch
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVLayout, KVTensorSpec
from onboard.engine.layers.deepseek_moe import DeepseekMoE
from onboard.engine.layers.dsa import runs_indexer
from onboard.engine.layers.dsa_pool import PooledIndexer
from onboard.engine.layers.kda import KimiDeltaAttention, kda_state_specs
from onboard.engine.layers.mla import MLAttention
from onboard.engine.layers.mlp import LlamaMLP
from onboard.engine.layers.residual import HyperConnection, close_streams, open_streams
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.models.base import DecoderLayer, DecoderModel
from onboard.engine.models.deepseek_v3 import mtp_layer_names
from onboard.engine.state_cache import StateLayout, state_seqs
from onboard.errors import OnboardError

_DSA = "deepseek_sparse_attention"


def dsa_layers(config: Any) -> tuple[int, ...]:
    return tuple(i for i, kind in enumerate(config.layer_types) if kind == _DSA)


def _check_shared(config: Any) -> None:
    """transformers hands a "shared" layer the top-k of the layer just before it, which must run an indexer."""
    for i in dsa_layers(config):
        if not runs_indexer(config, i) and (
            i == 0 or config.layer_types[i - 1] != _DSA or not runs_indexer(config, i - 1)
        ):
            raise OnboardError(f"layer {i} shares a DSA selection, but layer {i - 1} is no DSA layer with an indexer")


class Glm5NextModel(DecoderModel):
    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        _check_shared(config)
        mtp = mtp_layer_names(weights.names() if hasattr(weights, "names") else [], config.num_hidden_layers)
        if mtp:
            console.print(
                f"skipping {len(mtp)} multi-token-prediction tensors (model.layers.{config.num_hidden_layers}.*)"
            )
        self.quantized = getattr(weights, "quantization_config", None) is not None
        super().__init__(config, weights, layer_ids)

    def make_layer(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        attn = f"{prefix}.self_attn"
        if config.layer_types[layer_idx] == "linear_attention":
            mixer: torch.nn.Module = KimiDeltaAttention(config, weights, attn, layer_idx)
        else:
            indexer = (
                PooledIndexer(config, weights, f"{attn}.indexer", layer_idx)
                if runs_indexer(config, layer_idx)
                else None
            )
            mixer = MLAttention(
                config, weights, attn, layer_idx, interleaved=False, indexer=indexer,
                shares_selection=indexer is None, latent_norm_eps=config.rms_norm_eps,
            )  # fmt: skip
        limit = config.swiglu_limit
        if config.mlp_layer_types[layer_idx] == "sparse":
            mlp = DeepseekMoE(config, weights, f"{prefix}.mlp", "eager" if self.quantized else None, limit)
        else:
            mlp = LlamaMLP(config, weights, f"{prefix}.mlp", limit)
        residuals = (
            HyperConnection(config, weights, f"{prefix}.hc_attn"),
            HyperConnection(config, weights, f"{prefix}.hc_ffn"),
        )
        return DecoderLayer(config, weights, prefix, mixer, mlp, residuals=residuals)

    @classmethod
    def layout_for(cls, config: Any, dtype: torch.dtype) -> KVLayout:
        tensors = [KVTensorSpec("latent", (1, config.kv_lora_rank + config.qk_rope_head_dim), dsa_layers(config))]
        indexer_layers = tuple(i for i in dsa_layers(config) if runs_indexer(config, i))
        if indexer_layers:
            tensors.append(KVTensorSpec("index_k", (2 * config.index_head_dim,), indexer_layers))
        return KVLayout(tuple(tensors), dtype)

    @classmethod
    def state_layout_for(cls, config: Any, dtype: torch.dtype) -> StateLayout:
        return StateLayout(tuple(kda_state_specs(config, dtype)))

    def open_streams(self, embeddings: torch.Tensor) -> torch.Tensor:
        return open_streams(embeddings, self.config.hc_mult)

    def close_streams(self, x: torch.Tensor) -> torch.Tensor:
        return close_streams(x)

    def prepare(self, batch: ForwardBatch, ctx: StepContext) -> None:
        ctx.tables["state_seqs"] = state_seqs(batch.query_lens, batch.context_lens, batch.state_slots, batch.decoding)
