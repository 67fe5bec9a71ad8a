"""Loading a checkpoint larger than memory for llm-compressor: offloaded, MoE experts linearized.

`llmcompressor.utils.load_context` is llm-compressor's own entry for this: compressed-tensors'
offloaded loading (weights stay in their safetensors files until used; only changed tensors go
to the offload folder) and MoE experts loaded straight into one Linear per expert.  Experts
linearized after loading instead (what `oneshot` does to a model in memory) would be materialised
in memory whole, every layer at once.
"""

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from onboard.models.checkpoint import Checkpoint

# Architectures whose checkpoints store experts one by one, as llm-compressor's registered ones
# do, but which its table of experts classes (0.14) does not list yet; its documented extension
# point is this table (config class, experts class).
MOE_LAYOUTS = {
    "deepseek_v32": (
        "transformers.models.deepseek_v32.configuration_deepseek_v32.DeepseekV32Config",
        "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Experts",
    ),
}


@contextlib.contextmanager
def _legacy_aliases_hidden() -> Iterator[None]:
    """transformers 5.17's class patching (which the linearized load registers) walks every
    `transformers.*` module in sys.modules and lists its names; listing one of its lazy legacy
    aliases imports the aliased module, and some need packages onboard does not install
    (torchvision for the image processors).  No model code reads the aliases, so they leave
    sys.modules for the load and come back after."""
    hidden = {
        name: module
        for name, module in list(sys.modules.items())
        if name.startswith("transformers.")
        and getattr(module, "__file__", "") is None
        and (module.__doc__ or "").startswith("Alias module for backward compatibility")
    }
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


@contextlib.contextmanager
def conversion_mappings_kept() -> Iterator[None]:
    """The linearized load registers, process-wide, transformers' checkpoint conversion mappings of
    the architecture family (and saving needs them); they go back as they were afterwards, or every
    later MoE model saved in the process (a test's fixture, say) would be saved linearized."""
    import copy

    import transformers.conversion_mapping as mapping

    saved = copy.copy(mapping._checkpoint_conversion_mapping_cache)
    try:
        yield
    finally:
        mapping._checkpoint_conversion_mapping_cache = saved


def load_offloaded(checkpoint: Checkpoint, offload: Path, linearized: bool = True) -> torch.nn.Module:
    """The model with no weight in memory: each stays in its safetensors file or, once changed, in
    `offload`, and is read when its layer runs; oneshot then calibrates one decoder layer at a
    time.  (With 2.7 GB of weights kept in memory, the compression at save time, which copies what
    is resident, took a 16 GB model past its 6 GB cgroup; the page cache serves re-reads anyway.)

    `linearized=False` keeps transformers' fused MoE experts: the model as `load_model` has it in
    memory, the reference a selection measures against (not one oneshot can quantize)."""
    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor.modeling.moe.conversion_mappings import ARCH_TO_IMPORT_PATHS
    from llmcompressor.utils import load_context

    from onboard.models.vlm import auto_model_class

    for model_type, paths in MOE_LAYOUTS.items():
        ARCH_TO_IMPORT_PATHS.setdefault(model_type, paths)
    loading = load_context if linearized else load_offloaded_model
    auto = auto_model_class(checkpoint.config)
    with _legacy_aliases_hidden(), loading(auto):
        model = auto.from_pretrained(
            checkpoint.path,
            dtype=torch.bfloat16,
            device_map="auto_offload",
            max_memory={"cpu": 0},
            offload_folder=str(offload),
            use_safetensors=True,
            trust_remote_code=checkpoint.trust_remote_code,
        )
    _keep_in_fp32(model)
    return model.eval()


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether compressed-tensors offloads the model's weights (read from disk as each module runs)."""
    from compressed_tensors.offload.cache import OffloadCache

    return any(isinstance(module._parameters, OffloadCache) for module in model.modules())


def _keep_in_fp32(model: torch.nn.Module) -> None:
    """The float32 buffers transformers keeps (`_keep_in_fp32_modules_strict`: DeepSeek's routing
    bias) are left in the checkpoint's dtype by an offloaded load; a model in memory has them in
    float32, so the router computes and the artifact stores the same either way."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    for module in model.modules():
        for name in [n for n, b in module._buffers.items() if n in keep and b is not None and b.dtype != torch.float32]:
            value = module._buffers[name].float()
            del module._buffers[name]
            module._buffers[name] = value
