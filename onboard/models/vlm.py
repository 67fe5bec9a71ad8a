"""Vision-language checkpoints: a text model beside a vision tower, in one checkpoint.

This year's releases ship as VLMs (`Qwen3_5ForConditionalGeneration`, GLM-5.3-Flash's
`Glm5NextForConditionalGeneration`): config.json nests the text model's settings under
`text_config`, and the text model's tensors sit under `model.language_model.` beside the vision
tower and its projector under `model.visual.`.  onboard loads them with transformers' own VLM
class (the one llm-compressor's examples quantize and vLLM serves), feeds it text only, and keeps
the vision tensors as stored: never quantized, byte for byte in the artifact, checked by the gate
(`vision_kept`).  The engine serves the text model, reading its tensors through `checkpoint_name`.

A family is a line in `WRAPPERS`; `tests/models/test_vlm.py` holds each line against the
modules transformers builds.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onboard.models.headers import TensorEntry, safetensors_entries


@dataclass(frozen=True)
class Wrapper:
    """Where a VLM checkpoint keeps its parts (tensor-name prefixes)."""

    text_prefix: str  # the text model's `model.` (its decoder, embedding and final norm)
    kept_prefixes: tuple[str, ...]  # the vision tower and projector: stored as they are, never quantized


_QWEN_VL = Wrapper("model.language_model.", ("model.visual.",))

# by config.json's top-level model_type
WRAPPERS: dict[str, Wrapper] = {
    "qwen3_5": _QWEN_VL,
    "qwen3_5_moe": _QWEN_VL,
    "glm5_next": _QWEN_VL,
}

# Beside the weights and the tokenizer, what a VLM release needs to take images: vLLM and
# transformers' processors read these from the model directory.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)

# compressed-tensors `ignore` entries for the vision tower, as llm-compressor's VLM examples write
# them: `model.visual.*` in the checkpoint's names, `visual.*` in vLLM's (its weight mapper renames
# the modules, and a regex is not renamed with them).
VISION_IGNORE = ("re:visual.*", "re:model.visual.*")


def wrapper_of(config: dict[str, Any]) -> Wrapper | None:
    """The VLM layout of a checkpoint's config.json (None: a text model)."""
    return WRAPPERS.get(str(config.get("model_type", "")))


def auto_model_class(config: dict[str, Any]):
    """transformers' auto class for a checkpoint's config.json: a VLM loads as its own class (text
    in, logits out, the vision tower as stored), anything else as a causal LM."""
    import transformers

    if wrapper_of(config) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: a VLM's `text_config` under the checkpoint's `architectures`
    (what the engine's registry is keyed by); a text model's config as it is."""
    if wrapper_of(config) is None:
        return config
    text = dict(config.get("text_config") or {})
    text["architectures"] = list(config.get("architectures") or [])
    return text


def text_model_config(config: Any) -> Any:
    """transformers' config of the text model (a VLM's `text_config`) under the checkpoint's
    `architectures`, what the engine builds its model from."""
    text = config.get_text_config()
    if text is not config:
        text.architectures = list(getattr(config, "architectures", None) or [])
    return text


def checkpoint_name(name: str, wrapper: Wrapper | None) -> str:
    """The stored name of the text model's tensor `name` (`model.layers.0...` -> the wrapper's)."""
    if wrapper is not None and name.startswith("model."):
        return wrapper.text_prefix + name[len("model.") :]
    return name


def text_name(name: str, wrapper: Wrapper | None) -> str | None:
    """The text model's name of a stored tensor; None for the vision tower's."""
    if wrapper is None:
        return name
    if name.startswith(wrapper.text_prefix):
        return "model." + name[len(wrapper.text_prefix) :]
    if name.startswith(wrapper.kept_prefixes):
        return None
    return name


def read_config(directory: Path) -> dict[str, Any]:
    return json.loads((Path(directory) / "config.json").read_text())


def vision_entries(directory: Path, config: dict[str, Any] | None = None) -> dict[str, TensorEntry]:
    """The checkpoint's vision-tower tensors, from the safetensors headers."""
    wrapper = wrapper_of(config if config is not None else read_config(directory))
    if wrapper is None:
        return {}
    entries = safetensors_entries(directory)
    return {name: entry for name, entry in entries.items() if name.startswith(wrapper.kept_prefixes)}
