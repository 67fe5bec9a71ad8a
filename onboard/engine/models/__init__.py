"""The engine's model adapters, by the `architectures` name of a transformers config."""

from typing import Any

from onboard.engine.models.llama import LlamaModel, WeightSource
from onboard.engine.models.qwen3_moe import Qwen3MoeModel
from onboard.errors import OnboardError

MODEL_REGISTRY: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
}


class UnsupportedArchitecture(OnboardError):
    """The engine has no model adapter for this architecture."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def model_class(config: Any) -> type[LlamaModel]:
    """The engine model class for a transformers config (by `config.architectures[0]`)."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    name = archs[0] if archs else f"<none; model_type {getattr(config, 'model_type', None)!r}>"
    raise UnsupportedArchitecture(
        f"the serving engine does not support architecture {name}; supported: "
        f"{', '.join(supported_architectures())}. Adapters for new architectures go in onboard/engine/models/."
    )


__all__ = [
    "MODEL_REGISTRY",
    "LlamaModel",
    "Qwen3MoeModel",
    "UnsupportedArchitecture",
    "WeightSource",
    "model_class",
    "supported_architectures",
]
