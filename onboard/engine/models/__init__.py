"""The engine's model families, by the `architectures` name of a transformers config.

Adding a family is a file in this folder plus a line here; `docs/adding-an-architecture.md`
walks through one (MLA and DSA as the example).
"""

from typing import Any

from onboard.engine.models.base import DecoderModel
from onboard.engine.models.deepseek_v3 import DeepseekV3Model
from onboard.engine.models.glm4_moe import Glm4MoeModel
from onboard.engine.models.glm5_next import Glm5NextModel
from onboard.engine.models.gpt_oss import GptOssModel
from onboard.engine.models.lacking import LACKING
from onboard.engine.models.llama import LlamaModel
from onboard.engine.models.minimax_m2 import MiniMaxM2Model
from onboard.engine.models.qwen3_5 import Qwen3_5Model, Qwen3_5MoeModel
from onboard.engine.models.qwen3_moe import Qwen3MoeModel
from onboard.engine.models.qwen3_next import Qwen3NextModel
from onboard.errors import OnboardError

MODEL_REGISTRY: dict[str, type[DecoderModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
    "DeepseekV3ForCausalLM": DeepseekV3Model,
    "DeepseekV32ForCausalLM": DeepseekV3Model,
    "GlmMoeDsaForCausalLM": DeepseekV3Model,
    "Glm4MoeLiteForCausalLM": DeepseekV3Model,  # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE
    "Glm4MoeForCausalLM": Glm4MoeModel,
    "Qwen3_5ForCausalLM": Qwen3_5Model,  # Gated DeltaNet with a per-sequence state
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeModel,
    "Qwen3_5ForConditionalGeneration": Qwen3_5Model,  # the VLM release: its text model (models/vlm.py)
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeModel,
    "Qwen3NextForCausalLM": Qwen3NextModel,  # Qwen3.5's layers with fused DeltaNet projections
    "Glm5NextForConditionalGeneration": Glm5NextModel,  # GLM-5.3-Flash: KDA, NoPE MLA + pooled DSA, mHC
    "MiniMaxM2ForCausalLM": MiniMaxM2Model,  # whole-projection q/k norms, a sigmoid router without groups
    "GptOssForCausalLM": GptOssModel,  # attention sinks, alternating windows, biased clamped experts
}

GUIDE = "docs/adding-an-architecture.md"


class UnsupportedArchitecture(OnboardError):
    """The engine has no model adapter for this architecture."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def model_class(config: Any) -> type[DecoderModel]:
    """The engine model class for a transformers config (by `config.architectures[0]`)."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = getattr(config, "model_type", None)
    name = archs[0] if archs else f"<none; model_type {model_type!r}>"
    lacks = f" ({model_type}: the engine lacks {LACKING[model_type]})" if model_type in LACKING else ""
    raise UnsupportedArchitecture(
        f"the serving engine does not support architecture {name}{lacks}; supported: "
        f"{', '.join(supported_architectures())}. How to add one: {GUIDE}"
    )


def kv_layout_for(config: Any, dtype: Any = None):
    """The KV layout the engine allocates for `config` (bf16 unless `dtype`), no model built."""
    import torch

    return model_class(config).layout_for(config, dtype or torch.bfloat16)


def engine_model_name(config: Any) -> str:
    """The name of the engine class serving `config`; raises UnsupportedArchitecture."""
    return model_class(config).__name__


def uses_mla(config: Any) -> bool:
    """Whether the engine serves `config` with multi-head latent attention (DeepSeek-V3's family)."""
    return issubclass(model_class(config), DeepseekV3Model)


__all__ = [
    "LACKING",
    "MODEL_REGISTRY",
    "DecoderModel",
    "DeepseekV3Model",
    "Glm4MoeModel",
    "Glm5NextModel",
    "GptOssModel",
    "LlamaModel",
    "MiniMaxM2Model",
    "Qwen3MoeModel",
    "Qwen3NextModel",
    "Qwen3_5Model",
    "Qwen3_5MoeModel",
    "UnsupportedArchitecture",
    "engine_model_name",
    "kv_layout_for",
    "model_class",
    "supported_architectures",
    "uses_mla",
]
