"""The eval stage: the artifact against its reference on the same held-out tokens."""

import json
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from onboard import atomic
from onboard.budget import ModelShape, StagePlan, human, model_shape, plan_stage, resolve_budget
from onboard.console import console
from onboard.data import builtin_records, load_records, pack_tokens, tokens_by_traffic
from onboard.errors import OnboardError
from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.evaluate.per_layer import batch_windows, layer_formats, per_layer_kl, per_layer_table
from onboard.evaluate.streamed import streamed_kl, streamed_per_layer_kl
from onboard.hashing import fingerprint
from onboard.memory import release_freed_memory
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.paths import CALIBRATION_DIR
from onboard.recipes import Eval
from onboard.stage import StageContext, StageResult
from onboard.workspace import ARTIFACT, KL, SELECTION, RunDir, Stage, folder

CHUNK = 128  # positions per float32 logit block: 128 x vocab floats at a time


def eval_windows(tokenizer, settings: Eval, data: Path | None) -> list[tuple[str, list[int]]]:
    """Held-out text as (traffic, token window) pairs, each window from one traffic type.

    By default the built-in eval split, never calibration text; plain text, not chat-templated,
    so that a template's repeated system prompt does not pad the statistics.
    """
    records = load_records(data) if data else builtin_records("eval", settings.traffic)
    groups = tokens_by_traffic(
        records, tokenizer, chat=False, max_tokens=settings.max_tokens, max_length=settings.max_tokens
    )
    windows = [
        (traffic, window)
        for traffic, documents in groups.items()
        for window in pack_tokens(
            documents, window=settings.window, max_tokens=settings.max_tokens, separator=tokenizer.eos_token_id
        )
    ]
    if not windows:
        raise OnboardError(f"{data or 'the built-in eval split'} gives no token windows to evaluate")
    return windows


def kl_table(result: dict[str, Any], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for key in ("mean_kld", "median_kld", "p90_kld", "p99_kld", "max_kld"):
        table.add_row(f"{key} (nats)", f"{result[key]:.4f}")
    table.add_row("same top token", f"{100 * result['top1_agreement']:.2f} %")
    table.add_row("RMS Δp (reference top token)", f"{100 * result['rms_delta_p']:.2f} %")
    table.add_row("perplexity reference / quantized", f"{result['ppl_reference']:.3f} / {result['ppl_quantized']:.3f}")
    table.add_row("tokens", str(result["num_tokens"]))
    table.add_row("effective bits per weight", f"{result['effective_bits']:.3f}")
    for traffic, part in result.get("by_traffic", {}).items():
        table.add_row(
            f"  {traffic}: mean KLD / same top / tokens",
            f"{part['mean_kld']:.4f} / {100 * part['top1_agreement']:.1f} % / {part['num_tokens']}",
        )
    return table


def measure_kl(reference, quantized, windows: list[tuple[str, list[int]]]) -> dict[str, KLStats]:
    """KL statistics overall ("all") and per traffic type."""
    stats: dict[str, KLStats] = {"all": KLStats()}
    columns = (
        TextColumn("KL eval"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} windows"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("eval", total=len(windows))
        for traffic, window in windows:
            ids = torch.tensor([window])
            targets = ids[0, 1:]
            start = 0
            chunks = zip(
                logit_chunks(reference, ids[:, :-1], CHUNK), logit_chunks(quantized, ids[:, :-1], CHUNK), strict=True
            )
            for ref_chunk, quant_chunk in chunks:
                chunk_targets = targets[start : start + len(ref_chunk)]
                for key in ("all", traffic):
                    stats.setdefault(key, KLStats()).update(ref_chunk, quant_chunk, chunk_targets)
                start += len(ref_chunk)
            release_freed_memory()  # without it resident memory grows by a window's logits per window
            progress.advance(task)
    return stats


def eval_plan(
    shape: ModelShape, reference: ModelShape, settings: Eval, budget: int, options: str = "--endpoint URL"
) -> StagePlan:
    """The artifact's `shape` against the `reference`: in memory (both models resident) or streamed
    (two passes, one layer at a time); the per-layer KL's streams hold 2 x layers x per_layer_tokens
    hidden states."""
    tokens = settings.max_tokens + shape.num_layers * settings.per_layer_tokens
    return plan_stage("eval", shape, budget, tokens, reference=reference, options=options)


def run_eval(
    run: RunDir, settings: Eval, data: Path | None, out: Path | None = None, max_memory: int | None = None
) -> dict[str, Any]:
    quantize = run.require("quantize")
    reference_path = run.source
    plan = eval_plan(model_shape(run.artifact), model_shape(reference_path), settings, resolve_budget(max_memory))

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        reference_ckpt = inspect_checkpoint(reference_path)
        artifact_ckpt = inspect_checkpoint(run.artifact)
        tokenizer = load_tokenizer(artifact_ckpt)
        windows = eval_windows(tokenizer, settings, data)
        if plan.path == "streamed":
            console.print(f"eval streamed ({human(plan.streamed)} estimated; in memory {human(plan.in_memory)})")
            reference = quantized = None
            stats = streamed_kl(reference_path, run.artifact, windows)
        else:
            reference = load_model(reference_ckpt)
            quantized = load_model(artifact_ckpt)
            stats = measure_kl(reference, quantized, windows)
        overall = stats.pop("all")
        result = {**overall.summary(), "effective_bits": quantize["metrics"]["effective_bits"]}
        result["histogram"] = overall.histogram()
        result["data"] = str(data) if data else "builtin:eval"
        result["by_traffic"] = {traffic: s.summary() for traffic, s in stats.items()}
        if settings.per_layer_tokens:
            selection = json.loads(run.path(SELECTION).read_text())
            ids = batch_windows(windows, settings.per_layer_tokens)
            formats = layer_formats(selection["layers"])
            if reference is None:
                result["per_layer"] = streamed_per_layer_kl(reference_path, run.artifact, ids, formats)
            else:
                result["per_layer"] = per_layer_kl(reference, quantized, ids, formats)
        atomic.write_json(stage.path(KL), result)
        summary = {k: result[k] for k in ("mean_kld", "top1_agreement", "num_tokens", "effective_bits")}
        return {**summary, "memory_path": plan.path}

    inputs = {
        "quantize": quantize["key"],
        "artifact": quantize["outputs"][ARTIFACT],
        "eval": settings.model_dump(),
        "data": fingerprint(data) if data else f"builtin:{fingerprint(CALIBRATION_DIR)}",
    }
    entry = run.run_stage("eval", inputs, outputs=[folder(KL)], body=body)
    result = json.loads(run.path(KL).read_text())
    console.print(kl_table(result, f"KL divergence of {quantize['metrics']['scheme']} against the reference"))
    if result.get("per_layer"):
        console.print(per_layer_table(result["per_layer"]))
    if out:
        atomic.write_json(out, result)
    return entry


def plan(ctx: StageContext) -> StagePlan:
    """Before quantize, the unquantized checkpoint stands for both sides (the artifact is smaller).
    `onboard run` evaluates in-process only: its refusal names no --endpoint."""
    return eval_plan(ctx.shape, ctx.shape, ctx.recipe.eval, ctx.budget, options="")


def run(run_dir: RunDir, ctx: StageContext) -> StageResult:
    return run_eval(run_dir, ctx.recipe.eval, ctx.data, max_memory=ctx.budget)
