"""Loading a quantized mixture-of-experts artifact with one Linear module per expert.

transformers 5.17 fuses per-expert compressed tensors into 3-D expert weights on load and,
doing so, drops the NVFP4 global scales (experts come back scaled by them) and the activation
quantization. llmcompressor's own loading context relies on transformers' class patching,
which imports every lazy model module and fails without torchvision. So we build the model,
linearize its experts as llmcompressor did before quantizing them, lay out the compressed
parameters with compressed-tensors, load the stored tensors by name and decompress: the same
modules, names and numerics that were calibrated, and that vLLM serves.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PreTrainedModel

from onboard.models.compressed import fill_compressed
from onboard.models.conversion import convert_names, keep_in_fp32
from onboard.models.mtp import mtp_prefixes
from onboard.models.vlm import auto_model_class, text_config


def is_quantized_moe(config: dict) -> bool:
    text = text_config(config)
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    return bool(experts) and "quantization_config" in config


def load_quantized_moe(path: Path, dtype: torch.dtype, trust_remote_code: bool) -> PreTrainedModel:
    from compressed_tensors.quantization import QuantizationConfig
    from llmcompressor.modeling.moe.linearize import linearize_moe

    stored = json.loads((path / "config.json").read_text())
    quantization = QuantizationConfig.model_validate(stored["quantization_config"])
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    del config.quantization_config
    model = auto_model_class(stored).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    linearize_moe(model)
    keys = {k for m in model.modules() for k in getattr(m, "_keep_in_fp32_modules_strict", None) or []}
    keep_in_fp32(model, keys)  # from_config makes them bf16; from_pretrained would not
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    # MTP layers the artifact carries (quantize/mtp_carry.py) are no part of transformers' model.
    mtp = tuple(mtp_prefixes(stored, state))
    state = {name: tensor for name, tensor in state.items() if not (mtp and name.startswith(mtp))}
    state = convert_names(state, str(stored.get("model_type", "")))  # the family's renamings
    fill_compressed(model, quantization, state, f"{path} (linearized)")
    return model
