"""GLM-5.3-Flash's MTP layer (`model.language_model.layers.{N}.*`) as the engine's draft.

transformers 5.17 has no model of it: its `Glm5NextTextDecoderLayer` takes hyper-connection
streams, and the checkpoint's next-N layer is an ordinary residual block (no `hc_*` tensors, an
`eh_proj` of [H, 2H]), the layout vLLM's, SGLang's and llama.cpp's GLM-5.3-Flash MTP models load.
So the glue is written here, around transformers' own DSA attention (NoPE MLA with the pooled-key
indexer) and MoE:

    x = eh_proj([enorm(embed(token i+1)), hnorm(state at i)])
    x = x + self_attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
    out = shared_head.norm(x);  logits = lm_head(out)

`state at i` is the target's final-normed state (aux layer N, the streams' collapse), and `out`
is what a chain of K > 1 feeds back, as transformers' `MtpLayer` chains DeepSeek's layers. The
interface is `MtpDraftBase`'s (`mtp_base.py`).
"""

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, DynamicCache

from onboard.models.layers import fuse_experts, split_experts
from onboard.models.mtp import mtp_entries, mtp_prefixes
from onboard.models.vlm import read_config, text_model_config
from onboard.speculator.draft import DraftStep
from onboard.speculator.mtp_base import MtpDraftBase

# The served model's embedding and head are the draft's; the layer's copies stay in the artifact.
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class GlmMtpLayer(torch.nn.Module):
    """One next-N layer, its attributes named as the checkpoint names its tensors."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import (
            Glm5NextTextAttention,
            Glm5NextTextMoE,
            Glm5NextTextRMSNorm,
        )

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = Glm5NextTextRMSNorm(hidden, eps)
        self.hnorm = Glm5NextTextRMSNorm(hidden, eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = Glm5NextTextRMSNorm(hidden, eps)
        self.self_attn = Glm5NextTextAttention(config, 0)
        self.post_attention_layernorm = Glm5NextTextRMSNorm(hidden, eps)
        self.mlp = Glm5NextTextMoE(config)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = Glm5NextTextRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        rows = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # see `linear_keys`
        attended, _, _ = self.self_attn(
            hidden_states=self.input_layernorm(x), attention_mask=rows, past_key_values=cache, position_embeddings=None
        )
        x = x + attended
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)


def linear_keys(attention_mask: torch.Tensor | None, rows: int, past: int) -> None:
    """Refuse a mask the indexer cannot take. It pools keys by their place in the cache and
    applies causality itself, so a step's mask must be causal over the cache with padding only
    after the real keys: right-padded keys are then never visible to a real row, and the layer
    treats every key as valid (a padded row stays finite, and is never trained on)."""
    if attention_mask is None:
        return
    causal = torch.ones(rows, past + rows, dtype=torch.bool, device=attention_mask.device).tril(past)
    keys = attention_mask[:, :, -1:, :]
    prefix = keys.int().cumprod(-1).bool()
    if not (torch.equal(attention_mask, causal & keys) and torch.equal(keys, prefix)):
        raise ValueError(
            "GLM-5.3-Flash's MTP draft takes causal masks over right-padded keys "
            "(its DSA indexer pools keys by position)"
        )


class GlmMtp(torch.nn.Module):
    def __init__(self, config, layer: GlmMtpLayer, embed_tokens: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList([layer])
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed_tokens, freeze=True)
        self.head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, dtype=lm_head.dtype)
        self.head.weight = torch.nn.Parameter(lm_head, requires_grad=False)


class GlmMtpDraft(MtpDraftBase):
    """`MtpDraftBase`'s interface over the layer: its training unroll, step and checkpoint names."""

    def __init__(self, mtp: GlmMtp, num_hidden_layers: int, prefix: str):
        super().__init__(mtp, num_hidden_layers)
        self.prefix = prefix  # the layer's checkpoint names start with it

    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """DeepSeek-V3's MTP objective (its report, section 2.2), one module reused at every depth:
        depth s is a causal pass of its own over the sequence, fed the tokens s positions further on
        and depth s-1's output states. Training-time test's block masks (`draft.ttt_unroll`) would
        hand the pooled-key indexer keys out of their order; row i of depth s still predicts token
        i+2+s, so the loss is the same."""
        batch, length = input_ids.shape
        positions = torch.arange(1, length + 1, device=aux.device).expand(batch, length)
        mask = torch.ones(length, length, dtype=torch.bool, device=aux.device).tril()[None, None] & valid[:, None, None]
        hidden, logits = self.project(aux), []
        for s in range(steps):
            shifted = torch.cat([input_ids[:, s:], input_ids.new_zeros(batch, s)], dim=1)
            out = self.step(shifted, hidden, positions + s, mask, self.new_cache())
            logits.append(out.logits)
            hidden = out.hidden
        return logits

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache,
    ) -> DraftStep:
        """`input_ids` [B, T] (tokens i+1), `hidden` [B, T, H] (states at i); `attention_mask`
        [B, 1, T, past + T] boolean (causal, keys right-padded), None for one row attending to
        everything cached. NoPE: `position_ids` places nothing."""
        linear_keys(attention_mask, input_ids.shape[1], cache.get_seq_length())
        mtp, layer = self.mtp, self.mtp.layers[0]
        embeds = mtp.embed_tokens(input_ids)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden.to(embeds.dtype))], -1))
        out = layer(x, cache)
        return DraftStep(mtp.head(out).float(), out)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The layer in the checkpoint's names, experts one by one, without the shared copies."""
        state = split_experts(self.mtp.layers[0].state_dict())
        return {self.prefix + name: value.detach() for name, value in state.items()}


def load_glm_mtp_draft(path: Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype):
    """The next-N layer of the GLM-5.3-Flash checkpoint at `path`, sharing the served
    `embed_tokens` and `lm_head`."""
    from safetensors import safe_open
    from transformers.initialization import no_init_weights

    text = text_model_config(AutoConfig.from_pretrained(path))
    config = copy.deepcopy(text)
    config.quantization_config = None  # the layer is stored as the source had it
    config.num_hidden_layers, config.layer_types = 1, ["deepseek_sparse_attention"]
    config.indexer_types, config.mlp_layer_types = ["full"], ["sparse"]
    config._attn_implementation, config._experts_implementation = "sdpa", "eager"
    with no_init_weights():  # every parameter is loaded below
        layer = GlmMtpLayer(config)
    stored = read_config(path)
    (prefix,) = mtp_prefixes(stored, ())
    tensors = {}
    for name, entry in mtp_entries(path, stored).items():
        if name.removeprefix(prefix) not in _SHARED:
            with safe_open(str(entry.file), framework="pt") as handle:
                tensors[name.removeprefix(prefix)] = handle.get_tensor(name)
    layer.load_state_dict(fuse_experts(tensors, set(layer.state_dict())), strict=True)
    mtp = GlmMtp(config, layer, embed_tokens.to(dtype), lm_head.to(dtype))
    return GlmMtpDraft(mtp.to(device=embed_tokens.device, dtype=dtype).eval(), text.num_hidden_layers, prefix)
