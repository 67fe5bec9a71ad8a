"""Loading a validated checkpoint (or a .gguf file) into transformers objects."""

from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from onboard.errors import OnboardError
from onboard.models.checkpoint import Checkpoint, inspect_checkpoint
from onboard.models.compressed import drop_offload
from onboard.models.gguf import converted_gguf
from onboard.models.moe_artifact import is_quantized_moe, load_quantized_moe
from onboard.models.tokens import fix_special_tokens
from onboard.models.vlm import auto_model_class


def resolve_model(path: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Checkpoint:
    """MODEL as the CLI takes it: a checkpoint directory, or a .gguf file converted once to one."""
    path = Path(path).expanduser()
    if path.suffix.lower() == ".gguf":
        path = converted_gguf(path)
    return inspect_checkpoint(path, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)


def load_tokenizer(checkpoint: Checkpoint) -> PreTrainedTokenizerBase:
    from transformers import AutoConfig

    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path, trust_remote_code=checkpoint.trust_remote_code)
    config = AutoConfig.from_pretrained(checkpoint.path, trust_remote_code=checkpoint.trust_remote_code)
    return fix_special_tokens(tokenizer, config)


def load_model(checkpoint: Checkpoint, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    if is_quantized_moe(checkpoint.config):
        return load_quantized_moe(checkpoint.path, dtype, checkpoint.trust_remote_code).eval()
    try:
        model = auto_model_class(checkpoint.config).from_pretrained(
            checkpoint.path,
            dtype=dtype,
            use_safetensors=not checkpoint.allow_pickle or None,
            trust_remote_code=checkpoint.trust_remote_code,
        )
    except ValueError as err:
        raise OnboardError(
            f"{checkpoint.path}: transformers cannot load it as a causal LM: {str(err).splitlines()[0]}"
        ) from err
    _decompress(model)
    return model.eval()


def _decompress(model: PreTrainedModel) -> None:
    """Unpack a compressed-tensors checkpoint now rather than in the first forward's hook.

    transformers defers it to a hook on the top-level forward, so calling a submodule first
    (the decoder alone, as the KL eval does) would meet packed weights.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None)
    if getattr(config, "is_quantization_compressed", False) and getattr(quantizer, "compressor", None):
        quantizer.compressor.decompress_model(model=model)
        drop_offload(model)
