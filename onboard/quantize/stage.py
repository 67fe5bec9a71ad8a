"""The quantize stage: llmcompressor oneshot to a compressed-tensors checkpoint in artifact/."""

import os
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.hashing import fingerprint
from onboard.models import Checkpoint, load_model, load_tokenizer
from onboard.paths import CALIBRATION_DIR
from onboard.quantize.bits import effective_bits, is_quantizable, layer_bits
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.schemes import SCHEMES
from onboard.recipes import Quantize
from onboard.workspace import RunDir, Stage, console


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def quantize_inputs(checkpoint: Checkpoint, settings: Quantize, calib: Path | None) -> dict[str, Any]:
    return {
        "model": fingerprint(checkpoint.path),
        "model_path": str(checkpoint.path.resolve()),
        "quantize": settings.model_dump(),
        "calib": fingerprint(calib) if calib else f"builtin:{fingerprint(CALIBRATION_DIR)}",
    }


def _oneshot(model, tokenizer, settings: Quantize, calib: Path | None) -> int:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    scheme = SCHEMES[settings.scheme]
    modifier = QuantizationModifier(targets=settings.targets, scheme=scheme.preset, ignore=settings.ignore)
    if not scheme.calibrated:
        oneshot(model=model, tokenizer=tokenizer, recipe=modifier)
        return 0
    dataset = calibration_dataset(tokenizer, settings.calibration, calib)
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=modifier,
        max_seq_length=settings.calibration.max_seq_length,
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
    )
    return sum(len(ids) for ids in dataset["input_ids"])


def run_quantize(run: RunDir, checkpoint: Checkpoint, settings: Quantize, calib: Path | None) -> dict[str, Any]:
    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        tokenizer = load_tokenizer(checkpoint)
        model = load_model(checkpoint)
        console.print(f"quantizing {checkpoint.path.name} to {settings.scheme}: {SCHEMES[settings.scheme].summary}")
        calib_tokens = _oneshot(model, tokenizer, settings, calib)

        artifact = stage.path("artifact")
        model.save_pretrained(artifact, save_compressed=True)
        tokenizer.save_pretrained(artifact)
        # llmcompressor leaves the recipe it applied beside the weights; keep it, it is data.
        layers = layer_bits(artifact)
        bits = effective_bits(layers)
        selection = {
            "scheme": settings.scheme,
            "algorithm": "rtn",
            "effective_bits": bits,
            "effective_bits_all_weights": effective_bits(layers, only_quantizable=False),
            "ignore": settings.ignore,
            "layers": {k: {**v, "quantizable": is_quantizable(k)} for k, v in layers.items()},
            "search": [],
        }
        atomic.write_json(stage.path("quantize/selection.json"), selection)
        return {
            "scheme": settings.scheme,
            "effective_bits": bits,
            "calibration_tokens": calib_tokens,
            "bytes_reference": _dir_bytes(checkpoint.path),
            "bytes_artifact": _dir_bytes(artifact),
            "quantized_layers": sum(1 for v in layers.values() if v["format"] not in ("bf16", "f16", "f32")),
        }

    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "WARNING")
    return run.run_stage(
        "quantize",
        quantize_inputs(checkpoint, settings, calib),
        outputs=["artifact", "quantize"],
        body=body,
    )
