"""Qwen3.5's and Qwen3-Next's MTP module (`mtp.*`) as the engine's draft.

transformers 5.17 has no model of it (it drops `mtp.*` on load, and no class reads
`mtp_num_hidden_layers`), so the module's glue is written here, in the layout vLLM's Qwen3.5
MTP model loads; its decoder layer is transformers' own (`Qwen3_5DecoderLayer` or the MoE one,
full attention), with the family's norm class:

    e = pre_fc_norm_embedding(embed(token i+1));  h = pre_fc_norm_hidden(state at i)
    x = layers.0(fc([e, h]));  out = norm(x);  logits = lm_head(out)

`state at i` is the target's final-normed state (transformers' last `hidden_states` entry, aux
layer N), and `out` is what a chain of K > 1 feeds back as the next state, as vLLM chains it. The
interface is `MtpDraftBase`'s (`mtp_base.py`), so serving, measuring and `--draft mtp` fine-tuning
take either layout.
"""

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, DynamicCache

from onboard.models.layers import fuse_experts, split_experts
from onboard.models.mtp import MODULE_PREFIX, mtp_entries
from onboard.models.vlm import text_model_config
from onboard.speculator.draft import DraftStep, additive_mask
from onboard.speculator.mtp_base import MtpDraftBase

_BLOCK = "layers.0."  # within the module: its one decoder layer


class QwenMtpLayer(torch.nn.Module):
    def __init__(self, config, layer_class, norm_class):
        super().__init__()
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=config.rms_norm_eps)
        self.block = layer_class(config, 0)
        self.norm = norm_class(hidden, eps=config.rms_norm_eps)


class QwenMtp(torch.nn.Module):
    """The module's layers beside the served model's embedding and head (shared, frozen)."""

    def __init__(self, config, layer: QwenMtpLayer, embed_tokens: torch.Tensor, lm_head: torch.Tensor, rotary):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList([layer])
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed_tokens, freeze=True)
        self.shared_head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, dtype=lm_head.dtype)
        self.shared_head.weight = torch.nn.Parameter(lm_head, requires_grad=False)
        self.rotary_emb = rotary


class QwenMtpDraft(MtpDraftBase):
    """`MtpDraftBase`'s interface over the module: its step and checkpoint names."""

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache,
    ) -> DraftStep:
        """`input_ids` [B, T] (tokens i+1), `hidden` [B, T, H] (states at i); `attention_mask`
        [B, 1, T, past + T] boolean, None for one row attending to everything cached."""
        mtp, layer = self.mtp, self.mtp.layers[0]
        embeds = mtp.embed_tokens(input_ids)
        additive = additive_mask(attention_mask, input_ids.shape[1], cache.get_seq_length(), embeds)
        x = layer.fc(
            torch.cat([layer.pre_fc_norm_embedding(embeds), layer.pre_fc_norm_hidden(hidden.to(embeds.dtype))], -1)
        )
        # MRoPE over text: the same position on each of its three axes.
        rope_ids = position_ids[None].expand(3, *position_ids.shape)
        out = layer.block(
            x,
            position_embeddings=mtp.rotary_emb(x, rope_ids),
            attention_mask=additive,
            position_ids=position_ids,
            past_key_values=cache,
        )
        out = layer.norm(out)
        return DraftStep(mtp.shared_head(out).float(), out)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The module's layers in the checkpoint's names (`mtp.*`), experts one by one."""
        layer = {name.replace("block.", _BLOCK, 1): value for name, value in self.mtp.layers[0].state_dict().items()}
        out = {MODULE_PREFIX + name: value for name, value in split_experts(layer).items()}
        return {name: value.detach() for name, value in out.items()}


def _family_classes(config):
    """transformers' full-attention decoder layer, norm and rotary classes of `config`'s family,
    read off its text model built on the meta device (as transformers' `MtpModel` infers them)."""
    from transformers import AutoModel

    with torch.device("meta"):
        decoder = AutoModel.from_config(config)
    return type(decoder.layers[0]), type(decoder.norm), type(decoder.rotary_emb)


def load_qwen_mtp_draft(path: Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype):
    """The `mtp.*` module of the checkpoint at `path`, sharing the served `embed_tokens` and `lm_head`."""
    from safetensors import safe_open

    text = text_model_config(AutoConfig.from_pretrained(path))
    config = copy.deepcopy(text)
    config.quantization_config = None  # the module is stored as the source had it
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    config._attn_implementation = "sdpa"
    from transformers.initialization import no_init_weights

    layer_class, norm_class, rotary_class = _family_classes(config)
    with no_init_weights():  # every parameter is loaded below
        layer = QwenMtpLayer(config, layer_class, norm_class)
    stored = {}
    for name, entry in mtp_entries(path).items():
        with safe_open(str(entry.file), framework="pt") as handle:
            stored[name.removeprefix(MODULE_PREFIX)] = handle.get_tensor(name)
    block = {k.removeprefix(_BLOCK): v for k, v in stored.items() if k.startswith(_BLOCK)}
    wanted = set(layer.block.state_dict())
    state = {f"block.{k}": v for k, v in fuse_experts(block, wanted).items()}
    state.update({k: v for k, v in stored.items() if not k.startswith(_BLOCK)})
    layer.load_state_dict(state, strict=True)
    mtp = QwenMtp(config, layer, embed_tokens.to(dtype), lm_head.to(dtype), rotary_class(config=config))
    return QwenMtpDraft(mtp.to(device=embed_tokens.device, dtype=dtype).eval(), text.num_hidden_layers)
