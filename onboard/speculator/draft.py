"""The EAGLE-3 draft: one transformers Llama decoder layer over [token embedding | fused target state].

Module and buffer names are the `speculators` library's `Eagle3DraftModel` names, so the state
dict exports as is (`export.py`): `fc`, `layers.0.{hidden_norm,input_layernorm,self_attn.*,
post_attention_layernorm,mlp.*}`, `norm`, `lm_head`, `d2t`, `t2d` and the frozen `embed_tokens`.

Data alignment (as `speculators` trains it): the draft at position i sees the target's auxiliary
states at i (fused by `fc`) and the embedding of token i+1, and predicts token i+2 over the draft
vocabulary; draft id `d` is target id `d + d2t[d]`.  Training-time test unrolls K steps: step s
attends to the step-0 keys causally and to its own position in steps 1..s (the keys inference
would have cached), feeding the draft's own output state forward.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding


def draft_layer_config(target: LlamaConfig | object) -> LlamaConfig:
    """The draft decoder layer's config: the target's attention and MLP shapes, one layer."""
    text = target.get_text_config() if hasattr(target, "get_text_config") else target
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    config = LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=getattr(text, "hidden_act", "silu"),
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters=getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


class Eagle3FirstLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention reads [norm(embedding) | hidden_norm(state)] (2H wide);
    the residual stream is the fused state."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, layer_idx=0)
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn.q_proj = torch.nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.self_attn.k_proj = torch.nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = torch.nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: DynamicCache,
    ) -> torch.Tensor:
        attn_in = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn_out, _ = self.self_attn(
            hidden_states=attn_in,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        )
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DraftStep:
    logits: torch.Tensor  # [B, T, draft_vocab] float32
    hidden: torch.Tensor  # [B, T, H] the layer's output state (fed to the next step)


class Eagle3Draft(torch.nn.Module):
    def __init__(
        self, layer_config: LlamaConfig, draft_vocab_size: int, aux_layer_ids: list[int], fc_norm: bool = True
    ):
        super().__init__()
        hidden = layer_config.hidden_size
        self.layer_config = layer_config
        self.aux_layer_ids = list(aux_layer_ids)
        self.draft_vocab_size = draft_vocab_size
        self.embed_tokens = torch.nn.Embedding(layer_config.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        # Per-layer RMSNorm of each auxiliary state before `fc` (speculators' `fc_norm`): residual
        # streams carry attention-sink outliers in the thousands that otherwise swamp `fc`.
        self.fc_norm = (
            torch.nn.ModuleList(LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps) for _ in aux_layer_ids)
            if fc_norm
            else None
        )
        self.fc = torch.nn.Linear(len(aux_layer_ids) * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList([Eagle3FirstLayer(layer_config)])
        self.norm = LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=layer_config)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(layer_config.vocab_size, dtype=torch.bool))

    def init_from_target(self, embed: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """Copy the target's embedding (frozen), its output head restricted to the draft vocabulary
        (frozen, as `speculators` trains it) and its final norm (trainable) into the draft."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(lm_head[torch.nonzero(self.t2d).squeeze(1)])
            self.norm.weight.copy_(final_norm)
        self.lm_head.weight.requires_grad_(False)

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Draft vocabulary = these target ids (sorted); fills `d2t` offsets and the `t2d` mask."""
        ids = draft_to_target.to(torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The fused target state: `fc` over the (per-layer normed) concatenated auxiliary states."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache,
    ) -> DraftStep:
        """One pass of the decoder layer: `input_ids` [B, T] target ids, `hidden` [B, T, H] (the
        fused target state or the previous step's output), new K/V appended to `cache`."""
        embeds = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(embeds, position_ids)
        out = self.layers[0](embeds, hidden, position_embeddings, attention_mask, cache)
        return DraftStep(self.lm_head(self.norm(out)).float(), out)

    def unroll(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        return ttt_unroll(self, aux, input_ids, valid, steps)


def additive_mask(attention_mask: torch.Tensor | None, rows: int, past: int, like: torch.Tensor) -> torch.Tensor:
    """A draft step's boolean mask `[B, 1, rows, past + rows]` (None: every row sees everything
    cached) as the additive one transformers' eager attention adds (SDPA takes either form)."""
    if attention_mask is None:
        attention_mask = torch.ones(1, 1, rows, past + rows, dtype=torch.bool)
    additive = torch.zeros(attention_mask.shape, dtype=like.dtype, device=like.device)
    return additive.masked_fill(~attention_mask.to(like.device), torch.finfo(like.dtype).min)


def ttt_unroll(
    draft, aux: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Training-time test over padded sequences, for any draft with `project`, `step` and
    `new_cache`: `aux` [B, T, A*H] target states at positions 0..T-1, `input_ids` [B, T] the tokens
    at 1..T, `valid` [B, T] key padding.  Step s feeds the tokens s positions further on and the
    previous step's own output state; returns the logits of each step ([B, T, draft_vocab]; row i
    of step s predicts token i+2+s)."""
    batch, length = input_ids.shape
    positions = torch.arange(1, length + 1, device=aux.device).expand(batch, length)
    causal = torch.ones(length, length, dtype=torch.bool, device=aux.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=aux.device)
    keys_valid = valid[:, None, None, :]
    hidden = draft.project(aux)
    cache = draft.new_cache()
    logits = []
    blocks = [causal]
    for s in range(steps):
        shifted = torch.cat([input_ids[:, s:], input_ids.new_zeros(batch, s)], dim=1)
        mask = torch.cat(blocks, dim=1)[None, None] & keys_valid.repeat(1, 1, 1, len(blocks))
        out = draft.step(shifted, hidden, positions + s, mask, cache)
        logits.append(out.logits)
        hidden = out.hidden
        blocks.append(diagonal)
    return logits
