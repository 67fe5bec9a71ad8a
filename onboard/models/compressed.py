"""compressed-tensors' lifecycle on a model onboard builds itself (an MoE with linearized experts,
one decoder layer of an artifact), as `from_pretrained` runs it on a whole model."""

from typing import Any

import torch

from onboard.errors import OnboardError


def fill_compressed(model: torch.nn.Module, quantization: Any, state: dict[str, torch.Tensor], what: str) -> None:
    """Attach `quantization`'s schemes, lay out the packed parameters the stored tensors `state`
    fill, load them, decompress, and leave plain tensors (`drop_offload`) whose experts quantize
    their inputs per token.  `what` names the model in the one-line error of a mismatch."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    apply_quantization_config(model, quantization, run_compressed=False)
    compressor = ModelCompressor(quantization_config=quantization)
    compressor.compress_model(model)  # the packed parameter layout the stored tensors fill
    result = model.load_state_dict(state, strict=False)
    stray = [k for k in result.missing_keys if "rotary" not in k] + list(result.unexpected_keys)
    if stray:
        raise OnboardError(f"{what}: stored tensors do not match the model (e.g. {stray[0]})")
    compressor.decompress_model(model)
    drop_offload(model)
    quantize_expert_inputs_per_token(model)


def drop_offload(module: torch.nn.Module) -> None:
    """Plain tensors in place of the offloading compressed-tensors 0.19 leaves after decompressing.

    `decompress_model` goes through `from_accelerate`, which offloads every module to where it lies
    (the CPU): its tensors then sit in a cache that copies them back on every access, and its
    forward moves its inputs there, so a later `.to("cuda")` would leave the model computing on
    the CPU.  Removing the offload changes no bit where it lies."""
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(module)


def quantize_expert_inputs_per_token(model: torch.nn.Module) -> None:
    """Make linearized experts quantize their activations per token, as the format says.

    compressed-tensors' dynamic `token` strategy keeps dims 0 and 1 of an input and reduces the
    rest (`compute_dynamic_scales_and_zp`): per token for the [B, T, H] inputs of ordinary
    layers, but per ELEMENT for the 2-D [tokens, H] rows llmcompressor's `LinearExperts2D` hands
    each expert, so FP8 W8A8 experts would barely quantize their inputs (vLLM quantizes them per
    token).  Each expert runs on a [1, tokens, H] view instead: hooks, so copies keep them."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    for module in model.modules():
        if isinstance(module, LinearExperts2D):
            for expert in module:
                if not getattr(expert, "_onboard_tokenwise", False):
                    expert.register_forward_pre_hook(_as_tokens)
                    expert.register_forward_hook(_from_tokens)
                    expert._onboard_tokenwise = True


def _as_tokens(module: torch.nn.Module, args: tuple):
    x, *rest = args
    module._onboard_unsqueezed = x.dim() == 2
    return (x[None], *rest) if module._onboard_unsqueezed else None


def _from_tokens(module: torch.nn.Module, _args: tuple, output: torch.Tensor):
    unsqueezed, module._onboard_unsqueezed = module._onboard_unsqueezed, False
    return output[0] if unsqueezed else None
