"""The quantize stage: llmcompressor oneshot to a compressed-tensors checkpoint in artifact/."""

import copy
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.budget import (
    STREAMED_HOLDS,
    ModelShape,
    StagePlan,
    estimate,
    human,
    model_shape,
    plan_stage,
    resolve_budget,
)
from onboard.console import console
from onboard.errors import OnboardError
from onboard.hashing import fingerprint
from onboard.memory import map_large_blocks
from onboard.models import Checkpoint, load_model, load_tokenizer
from onboard.paths import CALIBRATION_DIR
from onboard.quantize import distributed, modifiers
from onboard.quantize.auto import Selection, artifact_kld
from onboard.quantize.bits import effective_bits, is_quantizable, layer_bits
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.distill import distill_scales, distill_windows
from onboard.quantize.kept import keep_vision
from onboard.quantize.method_choice import choose_method
from onboard.quantize.modifiers import needs_calibration, offloaded_copy
from onboard.quantize.mtp_carry import carry_mtp
from onboard.quantize.offloaded import conversion_mappings_kept, is_offloaded, load_offloaded
from onboard.quantize.schemes import LADDERS, SCHEMES
from onboard.recipes import Quantize
from onboard.stage import StageContext, StageResult
from onboard.workspace import ARTIFACT, SELECTION, RunDir, Stage, folder

SHARD_SIZE = "2GB"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def quantize_inputs(checkpoint: Checkpoint, settings: Quantize, calib: Path | None) -> dict[str, Any]:
    return {
        "model": fingerprint(checkpoint.path),
        "model_path": str(checkpoint.path.resolve()),
        "quantize": settings.model_dump(),
        "calib": fingerprint(calib) if calib else f"builtin:{fingerprint(CALIBRATION_DIR)}",
    }


def quantize_plan(shape: ModelShape, settings: Quantize, budget: int) -> StagePlan:
    """In memory, or streamed through llm-compressor's offloaded loading and sequential pipeline
    (the calibration samples' inputs of one layer resident).  `auto` plans the larger of its
    selection's peak (a model per format, the reference's distribution on the search tokens) and
    its calibration's.  Under torchrun every rank loads offloaded, whatever the budget."""
    tokens = settings.calibration.num_samples * settings.calibration.max_seq_length
    calibration = estimate("quantize", shape, tokens)
    peaks = calibration
    if settings.scheme == "auto":  # the selection, then the formats' copies and the artifact calibrate
        selection = estimate("selection", shape, settings.search.tokens)
        peaks = (max(selection[0], calibration[0]), max(selection[1] or 0, calibration[1] or 0))
    peaks = (peaks[0] + _in_memory_extra(shape, settings), peaks[1])
    plan = plan_stage("quantize", shape, budget, tokens, peaks=peaks)
    if distributed.world_size() > 1 and plan.path == "in-memory":  # distributed oneshot loads offloaded
        plan = replace(plan, path="streamed", bound=STREAMED_HOLDS["quantize"])
    return plan


def _in_memory_extra(shape: ModelShape, settings: Quantize) -> int:
    """What the in-memory-only steps hold beside the calibration: `--method auto`'s candidate copy,
    a search's smoothed or rotated copy (`modifiers.prepared_copy`) and distillation's BF16 teacher
    with the student's autograd state over one calibration window (float32 logits, their
    log-softmax and gradient, and each layer's saved activations)."""
    method = settings.method
    prepared = settings.scheme == "auto" and method != "auto" and (method.smoothing != "none" or method.rotations)
    extra = shape.total_bytes if method == "auto" or prepared else 0
    if settings.distill_tokens:
        window = min(settings.distill_tokens, settings.calibration.max_seq_length)
        per_token = 3 * 4 * shape.vocab_size + 20 * 4 * shape.num_layers * (shape.hidden_size + shape.intermediate_size)
        extra += shape.total_bytes + window * per_token
    return extra


def run_quantize(
    run: RunDir, checkpoint: Checkpoint, settings: Quantize, calib: Path | None, max_memory: int | None = None
) -> dict[str, Any]:
    budget = resolve_budget(max_memory)
    plan = quantize_plan(model_shape(checkpoint.path), settings, budget)
    distributed.check(settings.scheme, settings.calibration.num_samples, getattr(settings.method, "smoothing", "none"))
    if plan.path == "streamed" and (
        settings.method == "auto"
        or settings.method.rotations
        or settings.distill_tokens
        or (settings.scheme == "auto" and settings.method.smoothing != "none")
    ):
        raise OnboardError(
            f"quantize is over the memory budget ({human(plan.in_memory)} in memory): method auto, rotations, "
            "a search with smoothing and --distill-tokens run in memory only (--method rtn or gptq streams)"
        )

    method_record: dict[str, Any] = {}

    def body(stage: Stage) -> dict[str, Any]:
        nonlocal settings
        torch.manual_seed(0)
        tokenizer = load_tokenizer(checkpoint)
        if plan.path != "streamed":
            model = load_model(checkpoint)
            if settings.method == "auto":
                fmt = settings.base if settings.scheme == "auto" else settings.scheme
                dataset = calibration_dataset(tokenizer, settings.calibration, calib)
                chosen, record = choose_method(model, tokenizer, settings, fmt, dataset)
                method_record.update(record)
                settings = settings.model_copy(update={"method": chosen})
            return quantized(stage, model, tokenizer, selected(model, tokenizer, None))
        console.print(f"quantize streamed ({human(plan.streamed)} estimated; in memory {human(plan.in_memory)})")
        map_large_blocks()
        offload = stage.staging / "offload"
        try:
            with conversion_mappings_kept():
                picked = None
                if settings.scheme == "auto":
                    # The reference with transformers' own (fused) experts, as `load_model` has it,
                    # and one offloaded copy per format, whose quantized weights go to disk.
                    reference = load_offloaded(checkpoint, offload / "reference", linearized=False)
                    picked = selected(reference, tokenizer, offload)
                    sources = picked[0].sources
                    for fmt in list(sources):  # their disk copies are not needed any more
                        del sources[fmt]
                        shutil.rmtree(offload / fmt, ignore_errors=True)
                return quantized(stage, load_offloaded(checkpoint, offload / "quantized"), tokenizer, picked)
        finally:
            shutil.rmtree(offload, ignore_errors=True)

    def selected(model, tokenizer, offload: Path | None) -> tuple[Selection, dict[str, Any], Any] | None:
        """`auto`'s selection, its record and the calibration set it was measured on, or None."""
        if settings.scheme != "auto":
            return None
        dataset = calibration_dataset(tokenizer, settings.calibration, calib)
        console.print(f"selecting formats from {LADDERS[settings.base]} under {settings.bits_budget} bits per weight")
        source = None
        if offload is not None:

            def source(fmt: str):
                return offloaded_copy(checkpoint, offload / fmt, tokenizer, settings, fmt, dataset)

        selection = Selection(model, tokenizer, settings, dataset, [settings.bits_budget], source)
        _, record = selection.select(settings.bits_budget, settings.search.steps)
        return selection, record, dataset

    def quantized(stage: Stage, model, tokenizer, picked: tuple[Selection, dict[str, Any], Any] | None) -> dict:
        dataset = None
        auto: dict[str, Any] = {}
        scheme, pinned = settings.scheme, dict(settings.formats)
        if picked is not None:
            selection, auto, dataset = picked
            scheme, pinned = settings.base, auto["pinned"]
        console.print(f"quantizing {checkpoint.path.name} to {scheme}: {SCHEMES[scheme].summary}")
        for fmt, patterns in sorted(pinned.items()):
            console.print(f"  {len(patterns)} pinned to {fmt}: {SCHEMES[fmt].summary}")
        calibrated = None
        calibrates = needs_calibration(settings, {scheme, *pinned})
        if calibrates or settings.distill_tokens:
            calibrated = dataset if dataset is not None else calibration_dataset(tokenizer, settings.calibration, calib)
        # Distillation's teacher: the unquantized model, a second copy in memory (this path is in memory).
        teacher = copy.deepcopy(model).eval() if settings.distill_tokens else None
        modifiers.apply(
            model,
            tokenizer,
            modifiers.modifier(settings, scheme, pinned),
            distributed.share(calibrated) if calibrates else None,
            settings.calibration.max_seq_length,
        )
        distilled: dict[str, Any] = {}
        if teacher is not None:
            distilled = distill_scales(
                model, teacher, *distill_windows(calibrated["input_ids"], settings.distill_tokens)
            )
            del teacher
            console.print(
                f"distilled NVFP4 scales on {distilled['tokens']} tokens: KL on the "
                f"{distilled['held_back_tokens']} held-back calibration tokens "
                f"{distilled['held_back_kld_before']:.4f} -> {distilled['held_back_kld_after']:.4f}"
                + (
                    f" (epoch {distilled['best_epoch']} kept)"
                    if distilled["kept"]
                    else " (not kept: no epoch lowered it)"
                )
            )
        # The artifact scored on the search's tokens: in memory when the search composed on this
        # model, from the saved artifact when it is offloaded or the search ran on a smoothed or
        # rotated copy (which the artifact's own calibration smooths again, with its pins).
        in_place = bool(auto) and not is_offloaded(model) and selection.model is model
        if in_place:
            auto["artifact_kld"] = selection.replay.mean_kl()[0]

        # compressed-tensors 0.19 compresses for the save without waiting: a rank done calibrating
        # would delete offloaded weights (rank 0's files, shared) that another rank still reads.
        distributed.barrier()
        artifact = stage.path(ARTIFACT)
        # Shards of a fixed size, whatever the path: the same bytes in memory or streamed, and
        # an offloaded model is gathered one shard at a time.
        model.save_pretrained(artifact, save_compressed=True, max_shard_size=SHARD_SIZE)
        modifiers.patterns_first(artifact)
        modifiers.ignores_as_stored(artifact)
        tokenizer.save_pretrained(artifact)
        if auto and not in_place:
            auto["artifact_kld"] = artifact_kld(selection.replay, artifact)
        # llmcompressor leaves the recipe it applied beside the weights; keep it, it is data.
        layers = layer_bits(artifact)  # the main model's layers: before the MTP layers join them
        bits = effective_bits(layers)
        mtp = carry_mtp(checkpoint.path, artifact) if (artifact / "config.json").is_file() else {}
        vision = keep_vision(checkpoint.path, artifact)
        selection_record = {
            "scheme": settings.scheme,
            "method": settings.method.name,
            "method_settings": settings.method.model_dump(),
            **({"method_choice": method_record} if method_record else {}),
            **({"distill": distilled} if distilled else {}),
            "effective_bits": bits,
            "effective_bits_all_weights": effective_bits(layers, only_quantizable=False),
            "ignore": settings.ignore,
            "layers": {k: {**v, "quantizable": is_quantizable(k)} for k, v in layers.items()},
            "pinned": pinned,
            "search": [],
            "mtp": mtp,
            **({"vision": vision} if vision else {}),
            **auto,
        }
        atomic.write_json(stage.path(SELECTION), selection_record)
        return {
            "scheme": settings.scheme,
            "method": settings.method.name,
            **({"distilled": distilled["kept"]} if distilled else {}),
            "effective_bits": bits,
            "calibration_tokens": sum(len(ids) for ids in calibrated["input_ids"]) if calibrated else 0,
            "bytes_reference": _dir_bytes(checkpoint.path),
            "bytes_artifact": _dir_bytes(artifact),
            "quantized_layers": sum(1 for v in layers.values() if v["format"] not in ("bf16", "f16", "f32")),
            **({"mtp_tensors_kept": mtp["tensors"]} if mtp.get("tensors") else {}),
            **({"vision_tensors_kept": vision["tensors"]} if vision else {}),
            **({"search_kld": auto["final"]["measured_kld"], "bits_budget": settings.bits_budget} if auto else {}),
            "memory_path": plan.path,
        }

    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "WARNING")
    inputs, outputs = quantize_inputs(checkpoint, settings, calib), [ARTIFACT, folder(SELECTION)]
    # Under torchrun every rank calibrates or none does: rank 0's run directory decides.
    if distributed.world_size() > 1:
        runs = distributed.from_source(run.cached("quantize", inputs, outputs) is None)
        if not runs and distributed.rank() != 0:
            return {}
    return run.run_stage("quantize", inputs, outputs=outputs, body=body)


def plan(ctx: StageContext) -> StagePlan:
    return quantize_plan(ctx.shape, ctx.recipe.quantize, ctx.budget)


def run(run_dir: RunDir, ctx: StageContext) -> StageResult:
    return run_quantize(run_dir, ctx.checkpoint, ctx.recipe.quantize, ctx.calib, ctx.budget)
