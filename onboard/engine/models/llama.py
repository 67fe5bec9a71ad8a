"""The llama family as the engine runs it: llama, mistral, qwen2 and qwen3 in one class.

Differences between the families are read from the config and the checkpoint, not the name:

* q/k/v (qwen2) and o/mlp biases: whatever biases the checkpoint holds (`WeightSource.linear`);
* qwen3's per-head `q_norm`/`k_norm` RMSNorm before RoPE: used when the checkpoint has them;
* tied embeddings (`tie_word_embeddings`): lm_head is the embedding matrix;
* sliding window: per layer from `config.layer_types` (qwen2/qwen3 style) or, without layer types,
  from `config.sliding_window` (mistral).

Numerics follow transformers' modeling code op for op in the compute dtype (RMSNorm in float32
then cast, weight multiplied last; RoPE cos/sin cast to the compute dtype; residual adds and the
lm_head in the compute dtype, logits cast to float32 at the end), so bf16 outputs match
transformers up to matmul/SDPA reduction order.

Cheap per-step work happens once per forward, not per layer: the attention metadata (gather
indices, masks) and the RoPE cos/sin lookup.  q/k/v and gate/up are fused linears when the
weight source can fuse them; qwen3's q_norm and k_norm run as one norm over the fused q|k heads
(a stacked per-head weight), and RoPE rotates q and k in one pass.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from onboard.engine.attention import AttentionMetadata, paged_attention
from onboard.engine.batch import ForwardBatch
from onboard.engine.kv_cache import KVCache, KVCacheSpec
from onboard.engine.linear import EngineLinear
from onboard.engine.rope import RotaryEmbedding, apply_rotary, head_dim_of
from onboard.engine.weights import NotFusable


class WeightSource(Protocol):
    """Where the model gets its weights (`onboard.engine.weights.CheckpointWeights` implements it)."""

    def tensor(self, name: str) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...

    def linear(self, prefix: str) -> EngineLinear: ...

    def fused_linear(self, prefixes: Sequence[str]) -> EngineLinear:
        """One linear whose output is the prefixes' outputs concatenated; raises `NotFusable`."""
        ...


class RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, op for op: normalize in float32, cast back, then multiply by the
    weight in the input dtype.  (On CPU `F.rms_norm` decomposes into these same ops anyway; on CUDA
    its fused kernel could round differently.)  `weight` may have more than one dim (a stacked
    per-head weight `[heads, d]`); the norm is always over the last dim."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


def _linears(weights: WeightSource, prefixes: Sequence[str]) -> tuple[EngineLinear | None, list[EngineLinear] | None]:
    """A fused linear over `prefixes` if the source can fuse them, else the separate ones."""
    try:
        return weights.fused_linear(list(prefixes)), None
    except NotFusable:
        return None, [weights.linear(p) for p in prefixes]


@dataclass
class StepContext:
    """Per-forward state shared by all layers."""

    cache: KVCache
    attn: AttentionMetadata
    cos: torch.Tensor  # [T, 1, d]
    sin: torch.Tensor  # [T, 1, d], sign-folded (see rope.py)


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.qkv_proj, self.qkv_split = _linears(weights, [f"{prefix}.{p}_proj" for p in "qkv"])
        if self.qkv_split is not None:
            self.qkv_split = torch.nn.ModuleList(self.qkv_split)
        self.o_proj = weights.linear(f"{prefix}.o_proj")
        self.qk_norm = None
        if weights.has(f"{prefix}.q_norm.weight"):  # qwen3
            q_w = weights.tensor(f"{prefix}.q_norm.weight")
            k_w = weights.tensor(f"{prefix}.k_norm.weight")
            stacked = torch.cat([q_w.expand(self.num_heads, -1), k_w.expand(self.num_kv_heads, -1)])
            self.qk_norm = RMSNorm(stacked.contiguous(), config.rms_norm_eps)
        self.sliding_window = _sliding_window(config, layer_idx)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj.forward(x).view(t, h + 2 * kvh, d)
            qk, v = qkv[:, : h + kvh], qkv[:, h + kvh :]
        else:
            q_proj, k_proj, v_proj = self.qkv_split
            qk = torch.cat([q_proj(x).view(t, h, d), k_proj(x).view(t, kvh, d)], dim=1)
            v = v_proj(x).view(t, kvh, d)
        if self.qk_norm is not None:
            qk = self.qk_norm.forward(qk)
        qk = apply_rotary(qk, ctx.cos, ctx.sin)
        out = paged_attention(
            qk[:, :h], qk[:, h:], v, self.layer_idx, ctx.cache, ctx.attn, self.scale, self.sliding_window
        )
        return self.o_proj.forward(out.reshape(t, h * d))


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)); also one MoE expert."""

    def __init__(self, config: Any, weights: WeightSource, prefix: str):
        super().__init__()
        self.gate_up_proj, split = _linears(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.gate_proj, self.up_proj = split if split is not None else (None, None)
        self.down_proj = weights.linear(f"{prefix}.down_proj")
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj.forward(self.act_fn.forward(gate) * up)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int, mlp: torch.nn.Module):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(weights.tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = LlamaAttention(config, weights, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = RMSNorm(weights.tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), ctx)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaModel(torch.nn.Module):
    """A decoder-only llama-family model over the paged KV cache.

    `forward(batch, cache)` returns the final-normed hidden states `[T, H]` of the step's tokens;
    `compute_logits(hidden[batch.logits_indices])` the float32 logits.  Subclasses change the MLP
    of a layer by overriding `make_mlp`.
    """

    def __init__(self, config: Any, weights: WeightSource):
        super().__init__()
        self.config = config
        self.embed_tokens = weights.tensor("model.embed_tokens.weight")
        self.dtype = self.embed_tokens.dtype
        self.device = self.embed_tokens.device
        self.layers = torch.nn.ModuleList(
            DecoderLayer(
                config, weights, f"model.layers.{i}", i, self.make_mlp(config, weights, f"model.layers.{i}.mlp", i)
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(weights.tensor("model.norm.weight"), config.rms_norm_eps)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = EngineLinear(self.embed_tokens)
        else:
            self.lm_head = weights.linear("lm_head")
        self.rotary = RotaryEmbedding(config, self.dtype, self.device)

    def make_mlp(self, config: Any, weights: WeightSource, prefix: str, layer_idx: int) -> torch.nn.Module:
        return LlamaMLP(config, weights, prefix)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=head_dim_of(self.config),
            dtype=self.dtype,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, aux_layers: Sequence[int] = ()) -> torch.Tensor:
        attn = AttentionMetadata.build(batch, self.device)
        positions = batch.positions.to(self.device, non_blocking=True)
        cos, sin = self.rotary(positions, max_position=max(batch.context_lens, default=1) - 1)
        ctx = StepContext(cache=cache, attn=attn, cos=cos, sin=sin)
        x = F.embedding(batch.input_ids.to(self.device, non_blocking=True), self.embed_tokens)
        self.aux_hidden_states = []  # the inputs of `aux_layers` (transformers' hidden_states[i])
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                self.aux_hidden_states.append(x)
            x = layer.forward(x, ctx)
        return self.norm.forward(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S, H]` hidden states -> `[S, V]` float32 logits (lm_head in the compute dtype, as transformers)."""
        return self.lm_head.forward(hidden).float()
