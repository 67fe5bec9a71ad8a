"""The decoder-only model shape every family shares, over the paged cache.

`forward(batch, ctx)` returns a `ModelOutput`: the final-normed hidden states `[T, H]` of the
step's tokens and the inputs of `ctx.aux_layers` (transformers' `hidden_states[i]`, what an
EAGLE-3 draft reads; index `num_hidden_layers` is the final-normed state, what MTP layers read);
`compute_logits(hidden[batch.logits_indices])` the float32 logits.  A
family says how to build one decoder layer (`make_layer`), what it caches (`kv_layout`) and what
per-step tables its layers need (`prepare`, e.g. RoPE cos/sin).

The residual between layers is one stream `[T, H]`, or, for a family with hyper-connections
(GLM-5.3-Flash's mHC, `layers/residual.py`), `hc_mult` streams `[T, hc, H]`: the family opens them
from the embeddings (`open_streams`) and closes them before the final norm (`close_streams`), and
each decoder layer's residual objects take them around its attention and MLP.  An aux layer's
input is then the streams `[T, hc, H]`, as transformers' `hidden_states[i]` has them (the last,
index `num_hidden_layers`, is still the final-normed `[T, H]`).

Numerics follow transformers' modeling code op for op in the compute dtype (RMSNorm in float32
then cast, weight multiplied last; residual adds and the lm_head in the compute dtype, logits
cast to float32 at the end).
"""

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from onboard.engine.batch import ForwardBatch
from onboard.engine.context import ModelOutput, StepContext
from onboard.engine.kv_cache import KVLayout
from onboard.engine.layers.norm import RMSNorm
from onboard.engine.layers.residual import Residual
from onboard.engine.layers.weight_source import WeightSource
from onboard.engine.linear import EngineLinear
from onboard.engine.state_cache import StateLayout


class DecoderLayer(torch.nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); `residuals` (attention's, MLP's) replace the two
    additions (hyper-connections: the sub-layers then see the streams collapsed)."""

    def __init__(
        self,
        config: Any,
        weights: WeightSource,
        prefix: str,
        attn: torch.nn.Module,
        mlp: torch.nn.Module,
        norm: type[RMSNorm] = RMSNorm,
        residuals: Sequence[Residual] | None = None,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = norm(weights.tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = attn
        self.post_attention_layernorm = norm(weights.tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = mlp
        self.attn_residual, self.mlp_residual = residuals or (Residual(), Residual())

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.attn_residual.forward(x, lambda h: self.self_attn.forward(self.input_layernorm.forward(h), ctx))
        return self.mlp_residual.forward(x, lambda h: self.mlp.forward(self.post_attention_layernorm.forward(h)))


class DecoderModel(torch.nn.Module):
    """`layer_ids=()` builds the model without decoder layers: embeddings, final norm and head only,
    the layers then built one at a time with `make_layer` (layerwise parity)."""

    norm_class: type[RMSNorm] = RMSNorm  # the final norm's (Qwen3.5: zero-centred)

    def __init__(self, config: Any, weights: WeightSource, layer_ids: tuple[int, ...] | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = weights.tensor("model.embed_tokens.weight")
        self.dtype = self.embed_tokens.dtype
        self.device = self.embed_tokens.device
        ids = range(config.num_hidden_layers) if layer_ids is None else layer_ids
        self.layers = torch.nn.ModuleList(self.make_layer(config, weights, f"model.layers.{i}", i) for i in ids)
        self.norm = self.norm_class(weights.tensor("model.norm.weight"), config.rms_norm_eps)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = EngineLinear(self.embed_tokens, name="lm_head")
        else:
            self.lm_head = weights.linear("lm_head")

    @abstractmethod
    def make_layer(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module: ...

    @classmethod
    @abstractmethod
    def layout_for(cls, config: Any, dtype: torch.dtype) -> KVLayout:
        """What the family caches per token for `config`, without building a model."""

    @property
    def kv_layout(self) -> KVLayout:
        return self.layout_for(self.config, self.dtype)

    @classmethod
    def state_layout_for(cls, config: Any, dtype: torch.dtype) -> StateLayout | None:
        """What the family keeps per sequence besides its per-token cache (linear attention's
        state); None for a family with attention layers only."""
        return None

    @property
    def state_layout(self) -> StateLayout | None:
        return self.state_layout_for(self.config, self.dtype)

    def prepare(self, batch: ForwardBatch, ctx: StepContext) -> None:
        """Per-step tables the layers share (into `ctx.tables`)."""

    def open_streams(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The first layer's input from the embeddings `[T, H]`: one stream, as they are."""
        return embeddings

    def close_streams(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output as the final norm's input `[T, H]`."""
        return x

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, ctx: StepContext) -> ModelOutput:
        self.prepare(batch, ctx)
        x = self.open_streams(F.embedding(batch.input_ids.to(self.device, non_blocking=True), self.embed_tokens))
        aux = []
        for i, layer in enumerate(self.layers):
            if i in ctx.aux_layers:
                aux.append(x)
            x = layer.forward(x, ctx)
        final = self.norm.forward(self.close_streams(x))
        if len(self.layers) in ctx.aux_layers:  # transformers' last hidden_states entry: what MTP reads
            aux.append(final)
        return ModelOutput(final, aux)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S, H]` hidden states -> `[S, V]` float32 logits (lm_head in the compute dtype, as transformers)."""
        return self.lm_head.forward(hidden).float()
