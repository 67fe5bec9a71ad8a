"""A checkpoint's transformers pieces, built one decoder layer at a time from its safetensors.

What layerwise parity (`onboard.adapt.layerwise`) and the streamed stages
(`onboard.models.streamed`) run: a model larger than memory is never loaded whole. A plain
checkpoint's layer is transformers' decoder layer class with the stored tensors loaded into it. A
compressed-tensors artifact's layer is that class under compressed-tensors' own lifecycle, as
`from_pretrained` runs it on a whole model: the layer sits at its own name (`model.layers.N`)
inside an empty shell, so the config groups' targets and ignore patterns match it as they match the
whole model; `apply_quantization_config` attaches the schemes, `compress_model` lays out the packed
parameters the stored tensors fill, and `decompress_model` unpacks them, leaving the activation
fake-quantization compressed-tensors runs in the forward. Quantized MoE layers are linearized
first, as `models/moe_artifact.py` loads the whole model.

transformers 5 holds a plain checkpoint's MoE experts as fused 3-D tensors that checkpoints
store per expert; the per-layer load stacks them as its conversion mapping does (gate and up
concatenated), and applies the mapping's renamings and concatenations (GLM-5.3-Flash: `hc_attn_fn`
is `attn_hc.fn`, `self_attn.f_a_proj` is `self_attn.forget_gate.f_a_proj`, the q/k/v convs one).
Parameters the family keeps in float32 (`_keep_in_fp32_modules_strict`) are float32 here too.

With hyper-connections (`hc_mult`) the residual is streams `[b, T, hc, d]`: `open_streams` makes
the first layer's input from the embeddings, and `norm()` closes them (the family's `hc_head`)
before the final norm.
"""

import copy
import logging
import re
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from onboard.errors import OnboardError
from onboard.models.conversion import convert_names, keep_in_fp32

# Text models whose every layer takes the 2-D padding mask (GLM-5.3-Flash: its DSA indexer builds
# each query's keys, causality included, and KDA reads padding only); NoPE, no rotary.
_PADDING_MASK_ONLY = {"glm5_next_text"}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def tensor_index(path: Path) -> dict[str, list[str]]:
    """{shard file: tensor names} from the safetensors headers (nothing is read but headers)."""
    index = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            index[str(file)] = list(handle.keys())
    return index


def layer_tensors(path: Path, prefix: str, index: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors whose names start with `prefix`, without it; only their shards are opened."""
    out = {}
    for file, names in (index or tensor_index(path)).items():
        wanted = [name for name in names if name.startswith(prefix)]
        if wanted:
            with safe_open(file, framework="pt") as handle:
                for name in wanted:
                    out[name[len(prefix) :]] = handle.get_tensor(name)
    return out


def fuse_experts(tensors: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.E.{gate,up,down}_proj.weight` as transformers' fused parameters."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, value in tensors.items():
        match = _EXPERT.match(name)
        if match and "mlp.experts.gate_up_proj" in wanted:
            experts.setdefault(match.group(2), {})[int(match.group(1))] = value
        else:
            out[name] = value
    if experts:
        count = len(experts["gate_proj"])
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]]) for e in range(count)]
        )
        out["mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(count)])
    return out


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused `*mlp.experts.{gate_up_proj,down_proj}` back as the checkpoint's
    per-expert `*mlp.experts.E.{gate,up,down}_proj.weight` (`fuse_experts` reverted)."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1), strict=True)):
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


def check_layerwise(path: Path) -> Any:
    """The checkpoint's text-model config (a VLM's `text_config`, with the checkpoint's quantization
    config), or a one-line refusal of what a layer-by-layer run cannot build."""
    from transformers import AutoConfig

    from onboard.models.vlm import text_model_config

    top = AutoConfig.from_pretrained(path)
    config = text_model_config(top)
    if config is not top and getattr(top, "quantization_config", None):
        config.quantization_config = top.quantization_config
    return config


class CheckpointLayers:
    """transformers' decoder layers, final norm and rotary embedding for `config`, built on demand."""

    def __init__(self, path: Path, config: Any, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModel

        from onboard.models.vlm import read_config, wrapper_of

        top = read_config(path)
        self.wrapper = wrapper_of(top)  # a VLM's text tensors sit under its prefix
        self.model_type = str(top.get("model_type", ""))  # the conversion mapping's key
        config = copy.deepcopy(config)  # the engine keeps its own
        # what `from_pretrained` picks: SDPA, or eager where the family has no SDPA path (gpt-oss's sinks)

        supports_sdpa = getattr(AutoModel._model_mapping[type(config)], "_supports_sdpa", True)
        config._attn_implementation = "sdpa" if supports_sdpa else "eager"
        self.quantization = None
        self.linearize = False  # quantized MoE experts: one Linear per expert, as stored
        raw = getattr(config, "quantization_config", None)
        if raw:
            from compressed_tensors.quantization import QuantizationConfig

            from onboard.models.moe_artifact import is_quantized_moe

            raw = raw if isinstance(raw, dict) else raw.to_dict()
            self.quantization = QuantizationConfig.model_validate(raw)
            self.linearize = is_quantized_moe(config.to_dict())
            del config.quantization_config
        self.path, self.config, self.dtype, self.device = path, config, dtype, device
        with torch.device("meta"):  # the decoder alone: a family's text model may have no causal-LM class
            shell = AutoModel.from_config(config, dtype=dtype)
        self.layer_cls = type(shell.layers[0])
        self.norm_cls = type(shell.norm)
        hc_head = getattr(shell, "hc_head", None)  # closes hyper-connection streams (parameterless)
        self.hc_head_cls = None if hc_head is None else type(hc_head)
        rotary = getattr(shell, "rotary_emb", None)
        self.rotary = None if rotary is None else type(rotary)(config).to(device)
        self.keep_fp32 = set(getattr(shell, "_keep_in_fp32_modules_strict", None) or [])
        self.index = tensor_index(path)
        self.live_layers = 0  # decoder layers built here and not yet freed (the memory tests read the peak)
        self.peak_layers = 0

    def _built(self, module: torch.nn.Module) -> torch.nn.Module:
        self.live_layers += 1
        self.peak_layers = max(self.peak_layers, self.live_layers)
        weakref.finalize(module, self._freed)
        return module

    def _freed(self) -> None:
        self.live_layers -= 1

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The stored tensors under the text model's `prefix` (`model.layers.3.`), without it."""
        from onboard.models.vlm import checkpoint_name

        return layer_tensors(self.path, checkpoint_name(prefix, self.wrapper), self.index)

    def layer(self, index: int) -> torch.nn.Module:
        from transformers.initialization import no_init_weights

        with no_init_weights():  # every parameter is loaded from the checkpoint below
            module = self.layer_cls(self.config, index).to(self.dtype)
        keep_in_fp32(module, self.keep_fp32)
        prefix = f"model.layers.{index}."
        # renamed under the layer's prefix: a renaming may match across it (Mixtral's `.block_sparse_moe.`)
        stored = convert_names({prefix + k: v for k, v in self.tensors(prefix).items()}, self.model_type)
        stored = {k.removeprefix(prefix): v for k, v in stored.items()}
        if self.quantization is not None:
            module = self._compressed(module, index, stored)
        else:
            wanted = set(module.state_dict())
            tensors = fuse_experts(stored, wanted)
            missing = sorted(wanted - set(tensors))
            if missing:
                raise OnboardError(f"layerwise parity: model.layers.{index} has no stored {missing[0]}")
            module.load_state_dict({k: tensors[k] for k in wanted}, strict=True)
        return self._built(module.to(self.device).eval())

    def _compressed(self, module: torch.nn.Module, index: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        from onboard.models.compressed import fill_compressed
        from onboard.models.vlm import checkpoint_name

        # The layer at its stored name, which the config groups' targets and ignores speak.
        prefix = checkpoint_name(f"model.layers.{index}.", self.wrapper)
        shell = torch.nn.Module()
        shell.config = self.config
        parent = shell
        for part in prefix.split(".")[:-3]:
            parent.add_module(part, torch.nn.Module())
            parent = parent.get_submodule(part)
        parent.layers = torch.nn.ModuleDict({str(index): module})
        if self.linearize:
            from llmcompressor.modeling.moe.linearize import linearize_moe

            linearize_moe(shell)
        # The config's targets and ignores name every layer; only this one is here to match.
        matcher = logging.getLogger("compressed_tensors.utils.match")
        level = matcher.level
        matcher.setLevel(logging.ERROR)
        try:
            fill_compressed(shell, self.quantization, {prefix + k: v for k, v in tensors.items()}, prefix[:-1])
        finally:
            matcher.setLevel(level)
        return parent.layers[str(index)]

    def norm(self) -> torch.nn.Module:
        """The final norm (after the hyper-connection head, where the family has one)."""
        norm = self.norm_cls(self.config.hidden_size, eps=self.config.rms_norm_eps)
        norm.load_state_dict({"weight": self.tensors("model.norm.")["weight"]})
        if self.hc_head_cls is not None:
            norm = torch.nn.Sequential(self.hc_head_cls(), norm)
        return norm.to(device=self.device, dtype=self.dtype)

    def open_streams(self, embeds: torch.Tensor) -> torch.Tensor:
        """The first layer's input from the embeddings `[b, T, d]`: `hc_mult` copies `[b, T, hc, d]`
        where the family has hyper-connections, as its text model's forward makes them."""
        hc = getattr(self.config, "hc_mult", None)
        return embeds if hc is None else embeds.unsqueeze(2).expand(-1, -1, hc, -1).contiguous()

    def layer_kwargs(self, module: torch.nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """What the whole model's forward hands decoder layer `module` for `hidden` `[b, T, d]`: its
        mask (a linear-attention layer reads a padding mask, none here, not the causal one), the
        positions and the rotary embeddings (Qwen3.5's MRoPE takes a position per grid axis, text
        the same three times; a NoPE model has none)."""
        if self.config.model_type in _PADDING_MASK_ONLY:
            padding = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
            return {"attention_mask": padding, "position_ids": position_ids, "position_embeddings": None}
        linear = getattr(module, "layer_type", None) == "linear_attention"
        rope_ids = (
            position_ids.expand(3, *position_ids.shape) if hasattr(self.rotary, "mrope_section") else position_ids
        )
        sliding = getattr(getattr(module, "self_attn", None), "sliding_window", None) is not None
        return {
            "attention_mask": None if linear else self.mask(hidden, position_ids, sliding),
            "position_ids": position_ids,
            "position_embeddings": None if self.rotary is None else self.rotary(hidden, rope_ids),
        }

    def mask(self, embeds: torch.Tensor, position_ids: torch.Tensor, sliding: bool = False):
        """The mask transformers' text model builds for a layer: causal, or causal within the
        config's `sliding_window` for a sliding layer."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        sparse = getattr(self.config, "index_topk", None) is not None  # DSA layers always get a mask
        build = create_sliding_window_causal_mask if sliding else create_causal_mask
        return build(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
            allow_is_causal_skip=not sparse,
        )
