"""The eval stage: the artifact against its reference on the same held-out tokens."""

from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from onboard import atomic
from onboard.data import builtin_records, load_records, pack_tokens, tokenize_records
from onboard.errors import OnboardError
from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.hashing import fingerprint
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.paths import CALIBRATION_DIR
from onboard.recipes import Eval
from onboard.workspace import RunDir, Stage, console

CHUNK = 128  # positions per float32 logit block: 128 x vocab floats at a time


def eval_windows(tokenizer, settings: Eval, data: Path | None) -> list[list[int]]:
    """Held-out text as plain token windows; by default the eval split, never calibration."""
    records = load_records(data) if data else builtin_records("eval", settings.traffic)
    token_lists = tokenize_records(records, tokenizer, chat=False, max_length=10 * settings.window)
    windows = pack_tokens(
        token_lists, window=settings.window, max_tokens=settings.max_tokens, separator=tokenizer.eos_token_id
    )
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
    return table


def measure_kl(reference, quantized, windows: list[list[int]]) -> KLStats:
    stats = KLStats()
    columns = (TextColumn("KL eval"), BarColumn(), TextColumn("{task.completed}/{task.total} windows"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("eval", total=len(windows))
        for window in windows:
            ids = torch.tensor([window])
            targets = ids[0, 1:]
            start = 0
            for ref_chunk, quant_chunk in zip(
                logit_chunks(reference, ids[:, :-1], CHUNK), logit_chunks(quantized, ids[:, :-1], CHUNK), strict=True
            ):
                stats.update(ref_chunk, quant_chunk, targets[start : start + len(ref_chunk)])
                start += len(ref_chunk)
            progress.advance(task)
    return stats


def run_eval(run: RunDir, settings: Eval, data: Path | None, out: Path | None = None) -> dict[str, Any]:
    quantize = run.require("quantize")
    reference_path = Path(quantize["inputs"]["model_path"])

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        reference_ckpt = inspect_checkpoint(reference_path)
        artifact_ckpt = inspect_checkpoint(run.artifact)
        tokenizer = load_tokenizer(artifact_ckpt)
        windows = eval_windows(tokenizer, settings, data)
        reference = load_model(reference_ckpt)
        quantized = load_model(artifact_ckpt)
        stats = measure_kl(reference, quantized, windows)
        result = {**stats.summary(), "effective_bits": quantize["metrics"]["effective_bits"]}
        result["data"] = str(data) if data else "builtin:eval"
        atomic.write_json(stage.path("eval/kl.json"), result)
        return {k: result[k] for k in ("mean_kld", "top1_agreement", "num_tokens", "effective_bits")}

    inputs = {
        "quantize": quantize["key"],
        "artifact": quantize["outputs"]["artifact"],
        "eval": settings.model_dump(),
        "data": fingerprint(data) if data else f"builtin:{fingerprint(CALIBRATION_DIR)}",
    }
    entry = run.run_stage("eval", inputs, outputs=["eval"], body=body)
    result = __import__("json").loads((run.root / "eval/kl.json").read_text())
    console.print(kl_table(result, f"KL divergence of {quantize['metrics']['scheme']} against the reference"))
    if out:
        atomic.write_json(out, result)
    return entry
