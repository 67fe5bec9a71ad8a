"""GGUF files: dequantized once by transformers into a bf16 safetensors checkpoint."""

import shutil
import struct
from pathlib import Path

import torch

from onboard import atomic
from onboard.console import console
from onboard.errors import OnboardError
from onboard.hashing import fingerprint
from onboard.models.tokens import fix_special_tokens
from onboard.paths import cache_dir


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Write `gguf_file` as a bf16 safetensors checkpoint (tokenizer and chat template too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = out_dir.with_name(f".{out_dir.name}.partial")
    atomic.remove(staging)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (ValueError, OSError, KeyError, struct.error) as err:
        raise OnboardError(f"{gguf_file}: transformers cannot read this GGUF file: {str(err).splitlines()[0]}") from err
    # transformers refuses to serialise a model that still carries the GGUF quantizer; the
    # weights are already dequantized in memory, so dropping it is exact.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = ""
    if hasattr(model.config, "_model_name_or_path"):  # GGUF general.name, not a path
        del model.config._model_name_or_path
    tokenizer = fix_special_tokens(tokenizer, model.config)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    atomic.replace_tree(staging, out_dir)
    return out_dir


def converted_gguf(gguf_file: Path) -> Path:
    """The cached conversion of `gguf_file`, made on first use."""
    if not gguf_file.is_file():
        raise OnboardError(f"model path {gguf_file} does not exist")
    out_dir = cache_dir() / "gguf" / f"{gguf_file.stem}-{fingerprint(gguf_file)[:16]}"
    if not (out_dir / "config.json").exists():
        console.print(f"converting {gguf_file.name} to a bf16 safetensors checkpoint (once) ...")
        convert_gguf(gguf_file, out_dir)
    shutil.rmtree(out_dir.with_name(f".{out_dir.name}.partial"), ignore_errors=True)
    return out_dir
