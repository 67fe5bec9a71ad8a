"""A checkpoint's own MTP layers as the engine's draft (DeepSeek-V3/V3.2, GLM-5; Qwen's `mtp.`
module in `qwen_mtp_draft.py`, GLM-5.3-Flash's layer in `glm_mtp_draft.py`).

The layers are transformers' (`MtpModel`, loaded by its own `from_pretrained` with its renamings
and the family's expert conversions), so the draft is the reference implementation, not a copy
of it.  `MtpModel.from_pretrained` wants a main model only for its class, config and conversion
mapping: it gets one built on the meta device, which holds no weights, and the draft then takes
the served model's embedding and head (the MTP layers share them).

Alignment is EAGLE-3's (`draft.py`): row i reads the target's final-normed state at i and the
embedding of token i+1 and predicts token i+2.  The engine serves one MTP layer (DeepSeek-V3/V3.2
and GLM-5 ship one; more are refused in one line): every step of a chain runs it and feeds its
output state to the next step, transformers' chaining for the first and vLLM's reuse of the layer
beyond (`num_speculative_tokens` > 1).
"""

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from onboard.errors import OnboardError
from onboard.models.mtp import declared_mtp_layers
from onboard.speculator.draft import DraftStep, additive_mask
from onboard.speculator.mtp_base import MtpDraftBase


def mtp_config(config):
    """A copy of a transformers config with what transformers' MTP code reads and DeepSeek-V3.2's
    and GLM-5's configs lack: `num_mtp_layers` (their `num_nextn_predict_layers`) and the MTP
    layers' attention and MLP types (the main stack's attention type, MoE MLPs)."""
    config = copy.deepcopy(config)
    count = declared_mtp_layers(config.to_dict())
    config.num_mtp_layers = count
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and getattr(config, "mtp_layer_types", None) is None:
        config.mtp_layer_types = [layer_types[-1]] * count
    if getattr(config, "mlp_layer_types", None) is not None and getattr(config, "mtp_mlp_layer_types", None) is None:
        config.mtp_mlp_layer_types = ["sparse"] * count
    return config


class MtpDraft(MtpDraftBase):
    """The engine's draft interface (`engine/spec_decode.py`) over transformers' MTP layers."""

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The MTP layers in the checkpoint's names and layout (transformers' conversions reverted)."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {k: v.detach() for k, v in self.mtp.state_dict().items() if k.startswith("layers.")}
        return revert_weight_conversion(self.mtp, state)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache,
    ) -> DraftStep:
        """The MTP layer over `input_ids` [B, T] (tokens i+1) and `hidden` [B, T, H] (states at i);
        `attention_mask` [B, 1, T, past + T] boolean, None for one row attending to everything cached."""
        mtp = self.mtp
        embeds = mtp.embed_tokens(input_ids)
        additive = additive_mask(attention_mask, input_ids.shape[1], cache.get_seq_length(), embeds)
        # transformers' `MtpLayer.forward`, spelled out: GLM-5's decoder layer returns (state, top-k
        # indices), which `MtpLayer` hands to its norm as is (transformers 5.17).
        block = mtp.layers[0]  # the one layer the engine serves (`load_mtp_draft`)
        parts = [block.enorm(embeds), block.hnorm(hidden.to(embeds.dtype))]
        if getattr(mtp.config, "mtp_hidden_states_first", False):
            parts.reverse()
        out = block.mtp_block(
            block.eh_proj(torch.cat(parts, dim=-1)),
            attention_mask=additive,
            position_embeddings=mtp.rotary_emb(embeds, position_ids) if mtp.rotary_emb is not None else None,
            position_ids=position_ids,
            past_key_values=cache,
        )
        if isinstance(out, tuple):
            out = out[0]
        if block.use_post_norm:
            out = block.post_norm(out)
        if mtp.use_shared_post_norm:
            out = mtp.shared_post_norm(out)
        return DraftStep(mtp._project_to_logits(out).float(), out)


def load_mtp_draft(path: Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype) -> MtpDraftBase:
    """The MTP layers of the checkpoint at `path` (an artifact or a source), sharing the served
    model's `embed_tokens` [V, H] and `lm_head` [V, H]."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_layers import MtpModel

    from onboard.models.mtp import has_mtp_layers, module_layout
    from onboard.models.vlm import read_config

    stored = read_config(path)
    count = declared_mtp_layers(stored)
    if not has_mtp_layers(path, stored):
        raise OnboardError(f"{path} has no MTP layers (num_nextn_predict_layers and model.layers.N.* tensors)")
    if count != 1:
        raise OnboardError(f"{path} has {count} MTP layers; the engine serves one (vLLM serves more: --engine vllm)")
    if stored.get("model_type") == "glm5_next":  # a residual block that transformers has no model of
        from onboard.speculator.glm_mtp_draft import load_glm_mtp_draft

        return load_glm_mtp_draft(path, embed_tokens, lm_head, dtype)
    if module_layout(stored, None):  # Qwen's `mtp.` module
        from onboard.speculator.qwen_mtp_draft import load_qwen_mtp_draft

        return load_qwen_mtp_draft(path, embed_tokens, lm_head, dtype)
    raw = AutoConfig.from_pretrained(path)
    config = mtp_config(raw)
    config.quantization_config = None  # the main stack's format: the MTP layers are stored as they were
    with torch.device("meta"):
        main = AutoModelForCausalLM.from_config(config, dtype=dtype)
    main.config.name_or_path = str(path)
    # What `from_pretrained` would have recorded: the family's renamings and expert conversions.
    main._weight_conversions = get_model_conversion_mapping(main, add_legacy=False)
    # `MtpModel` finds the layers by the family's pattern, which names the release's layer number
    # (61 for DeepSeek-V3, 78 for GLM-5); this checkpoint's own number serves any depth.
    first = config.num_hidden_layers
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{first + k}\..*" for k in range(count)]
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"})
    mtp.embed_tokens = torch.nn.Embedding.from_pretrained(embed_tokens.to(dtype), freeze=True)
    head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, dtype=dtype)
    head.weight = torch.nn.Parameter(lm_head.to(dtype), requires_grad=False)
    mtp.shared_head = head
    rotary = getattr(main.get_decoder(), "rotary_emb", None)
    mtp.rotary_emb = type(rotary)(config=mtp.config) if rotary is not None else None
    return MtpDraft(mtp.to(device=embed_tokens.device, dtype=dtype).eval(), config.num_hidden_layers)
