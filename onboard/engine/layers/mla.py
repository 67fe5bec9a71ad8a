"""Multi-head Latent Attention (DeepSeek-V2/V3, V3.2, GLM-5), over a latent KV cache.

Per token and layer the cache holds ONE row: the normed compressed latent `c` (`kv_lora_rank`)
and the RoPE key (`qk_rope_head_dim`, shared by all heads) side by side, as vLLM lays it out;
never the expanded per-head K/V, which is the memory MLA exists to save.

* prefill (and verification rows on backends that do not verify row by row) uses the expanded
  form, as transformers computes it: K/V per head from `kv_b_proj(c)`, RoPE key broadcast over
  heads, one SDPA call per sequence;
* decode, in fast numerics in float32, uses the weight-absorbed form: the query's no-RoPE part
  is multiplied into the latent space (`q_nope @ W_UK`), attention runs as multi-query attention
  over the cached rows (values are the rows' first `kv_lora_rank` columns), and the output goes
  through the value up-projection `W_UV` before `o_proj`: no per-head K/V is ever built.
  Otherwise decode expands each row's context as prefill does: the same function, rounded as
  transformers rounds it.  In bf16 the absorbed form's other roundings grow into other greedy
  tokens beyond near-ties within a few dozen steps on small random models (fp32 agrees to 1e-5),
  so fast numerics keep the expanded form there (`onboard bench-kv` times both).  Where
  `kv_b_proj` quantizes its input (W4A4, FP8 W8A8) the absorbed form would skip that
  quantization, so decode stays expanded there (vLLM absorbs the dequantized weight regardless).

Queries come from `q_proj` or, with `q_lora_rank`, `q_b_proj(norm(q_a_proj(x)))`; q_a_proj and
kv_a_proj_with_mqa are one fused linear when the source can fuse them.  RoPE is interleaved as
DeepSeek applies it (`rope_interleave`, and always on V3.2 and GLM-5), or half-split; YaRN's
mscale enters both the cos/sin tables and the softmax scale (`mscale_all_dim`), as in
transformers.  With a DSA indexer (`dsa.py`, `dsa_pool.py`), each query attends only to its
selected keys.  `qk_rope_head_dim = 0` is MLA without RoPE (GLM-5.3-Flash): nothing is rotated, no
cos/sin tables are read, the latent row is `kv_lora_rank` wide and the scale is `qk_nope_head_dim**-0.5`
(transformers splits off an empty RoPE key and concatenates it back, which changes nothing).
"""

import math
from typing import Any

import torch

from onboard.engine.attention.base import merge_rows
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVTensorSpec
from onboard.engine.layers.dsa import Indexer, Selection
from onboard.engine.layers.norm import RMSNorm
from onboard.engine.layers.weight_source import WeightSource, fused_or_split
from onboard.engine.rope import apply_rotary, apply_rotary_interleaved

_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def softmax_scale(config: Any) -> float:
    """qk_head_dim**-0.5, times mscale**2 under YaRN with `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim", 0):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


def mla_kv_tensors(config: Any) -> list[KVTensorSpec]:
    layers = tuple(range(config.num_hidden_layers))
    return [KVTensorSpec("latent", (1, config.kv_lora_rank + config.qk_rope_head_dim), layers)]


class MLAttention(torch.nn.Module):
    def __init__(
        self,
        config: Any,
        weights: WeightSource,
        prefix: str,
        layer_idx: int,
        interleaved: bool,
        indexer: Indexer | None = None,
        shares_selection: bool = False,
        latent_norm_eps: float = _LATENT_NORM_EPS,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.interleaved = interleaved
        self.scale = softmax_scale(config)
        kv_a = f"{prefix}.kv_a_proj_with_mqa"
        self.q_proj = self.q_b_proj = self.q_a_layernorm = None
        if self.q_lora_rank is None:
            self.q_proj = weights.linear(f"{prefix}.q_proj")
            self.kv_a_proj = weights.linear(kv_a)
            self.qkv_a_proj = None
        else:
            self.qkv_a_proj, split = fused_or_split(weights, [f"{prefix}.q_a_proj", kv_a])
            self.q_a_proj, self.kv_a_proj = split if split is not None else (None, None)
            self.q_a_layernorm = RMSNorm(weights.tensor(f"{prefix}.q_a_layernorm.weight"), latent_norm_eps)
            self.q_b_proj = weights.linear(f"{prefix}.q_b_proj")
        self.kv_a_layernorm = RMSNorm(weights.tensor(f"{prefix}.kv_a_layernorm.weight"), latent_norm_eps)
        self.kv_b_proj = weights.linear(f"{prefix}.kv_b_proj")
        self.o_proj = weights.linear(f"{prefix}.o_proj")
        # Fast numerics decode in the absorbed form only in float32: in 16-bit dtypes its other
        # roundings part from transformers beyond near-ties on small random models (a flipped
        # routed expert), so bf16 keeps the expanded form (`onboard bench-kv` shows the cost).
        # Where kv_b_proj quantizes its input the absorbed form would skip that quantization.
        self.absorb = False
        self.w_uk = self.w_uv_t = None
        self.set_absorbed(self.kv_b_proj.weight.dtype == torch.float32)
        self.indexer = indexer
        self.shares_selection = shares_selection

    def set_absorbed(self, on: bool) -> None:
        """Fast numerics' decode form: absorbed (`on`, where kv_b_proj does not quantize its input)
        or expanded; the absorbed form holds W_UK and W_UV apart from kv_b_proj."""
        self.absorb = on and self.kv_b_proj.act_quant is None
        if self.absorb and self.w_uk is None:
            kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
            self.w_uk = kv_b[:, : self.nope].contiguous()  # [h, nope, rank]
            self.w_uv_t = kv_b[:, self.nope :].transpose(1, 2).contiguous()  # [h, rank, v]

    def _rotate(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.rope == 0:
            return x
        cos, sin = ctx.tables["cos"], ctx.tables["sin"]
        return apply_rotary_interleaved(x, cos, sin) if self.interleaved else apply_rotary(x, cos, sin)

    def _expanded(self, q: torch.Tensor, c: torch.Tensor, k_rot: torch.Tensor, mask, ctx: StepContext) -> torch.Tensor:
        """transformers' expanded MLA for one sequence: q `[q_len, h, nope+rope]` against latents `c`
        `[L, rank]` and RoPE keys `k_rot` `[L, rope]` -> `[q_len, h, v]`."""
        length = c.shape[0]
        kv = self.kv_b_proj.forward(c).view(length, self.num_heads, self.nope + self.v_dim)
        k = kv.new_empty(length, self.num_heads, self.nope + self.rope)
        k[..., : self.nope].copy_(kv[..., : self.nope])
        k[..., self.nope :].copy_(k_rot[:, None, :])
        return ctx.backend.prefill(q, k, kv[..., self.nope :], mask, self.scale)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        h, nope, rope, rank = self.num_heads, self.nope, self.rope, self.rank
        q_resid = None
        if self.q_lora_rank is None:
            q, ckv = self.q_proj.forward(x), self.kv_a_proj.forward(x)
        else:
            if self.qkv_a_proj is not None:
                q_a, ckv = self.qkv_a_proj.forward(x).split([self.q_lora_rank, rank + rope], dim=-1)
            else:
                q_a, ckv = self.q_a_proj.forward(x), self.kv_a_proj.forward(x)
            q_resid = self.q_a_layernorm.forward(q_a)
            q = self.q_b_proj.forward(q_resid)
        q = q.view(t, h, nope + rope)
        q_pass, q_rot = q[..., :nope], self._rotate(q[..., nope:], ctx)
        c, k_rot = ckv.split([rank, rope], dim=-1)
        c = self.kv_a_layernorm.forward(c)
        k_rot = self._rotate(k_rot.reshape(t, 1, rope), ctx).view(t, rope)
        ctx.backend.write(ctx.cache, self.layer_idx, ctx.attn, latent=torch.cat([c, k_rot], dim=-1).view(t, 1, -1))
        query = torch.cat([q_pass, q_rot], dim=-1)

        selection: Selection | None = None
        if self.indexer is not None:
            selection = self.indexer.select(x, q_resid, ctx)
            ctx.tables["dsa_selection"] = selection
        elif self.shares_selection:
            selection = ctx.tables["dsa_selection"]

        meta = ctx.attn
        decode_out = None
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            selected = selection.decode if selection is not None else None
            if self.absorb and ctx.numerics == "fast":
                q_lat = torch.bmm(q_pass[rows].transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, h, rank]
                q_abs = torch.cat([q_lat, q_rot[rows]], dim=-1)
                out = ctx.backend.decode(
                    q_abs, self.layer_idx, ctx.cache, meta, self.scale, keys="latent", values=None,
                    value_dim=rank, selected=selected, fold_heads=True,
                )  # fmt: skip
                decode_out = torch.bmm(out.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [B, h, v]
            else:
                decode_out = self._decode_expanded(query[rows], selected, ctx)
            if not meta.prefill:
                return self.o_proj.forward(decode_out.reshape(t, h * self.v_dim))

        outputs = []
        for i, seq in enumerate(meta.prefill):
            if seq.block_table is None:
                c_i, kr_i = c[seq.start : seq.end], k_rot[seq.start : seq.end]
            else:
                latent = ctx.backend.context(ctx.cache, "latent", self.layer_idx, seq)[:, 0]
                c_i, kr_i = latent[:, :rank], latent[:, rank:]
            if selection is None:
                mask = meta.prefill_mask_for(i, None)
            else:  # the selection (already causal), or where it is every key the explicit causal mask:
                # transformers always materializes the mask of a sparse-attention layer
                chosen = selection.prefill[i]
                mask = meta.explicit_causal_mask(i) if chosen is None else chosen
            outputs.append((seq, self._expanded(query[seq.start : seq.end], c_i, kr_i, mask, ctx)))
        out = merge_rows(query.new_empty(t, h, self.v_dim), meta, outputs, decode_out)
        return self.o_proj.forward(out.reshape(t, h * self.v_dim))

    def _decode_expanded(self, q: torch.Tensor, selected, ctx: StepContext) -> torch.Tensor:
        meta = ctx.attn
        rows = ctx.cache.gather("latent", self.layer_idx, meta.decode_blocks)[:, 0]
        outs = []
        for i, (start, length) in enumerate(zip(meta.decode_token_offsets, meta.decode_context_lens, strict=True)):
            latent = rows[start : start + length]
            mask = None
            if selected is not None:
                mask = torch.zeros(1, length, dtype=torch.bool, device=q.device)
                mask[0, selected[i]] = True
            outs.append(self._expanded(q[i : i + 1], latent[:, : self.rank], latent[:, self.rank :], mask, ctx))
        return torch.cat(outs)
