"""`onboard adapt`: the checkpoint in the reference engine, checked against transformers."""

import json
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard import atomic
from onboard.adapt.measure import measure_parity, parity_prompts
from onboard.budget import ModelShape, StagePlan, plan_stage
from onboard.console import console
from onboard.errors import OnboardError
from onboard.hashing import fingerprint
from onboard.models import Checkpoint, inspect_checkpoint, load_tokenizer
from onboard.stage import StageContext, StageResult, engine_model_for, engine_refusal, require_engine, skipped
from onboard.workspace import LAYERWISE, PARITY, RunDir, Stage, is_run


def parity_table(result: dict[str, Any]) -> Table:
    table = Table(title="engine against transformers, same weights", title_justify="left")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("max |Δ logit|", f"{result['max_abs_logit_diff']:.4f}")
    table.add_row("mean KLD (nats)", f"{result['mean_kld']:.2e}")
    table.add_row("same top token", f"{100 * result['top1_agreement']:.2f} %")
    table.add_row(f"identical {result['max_new_tokens']}-token greedy", f"{100 * result['greedy_match_rate']:.1f} %")
    table.add_row("divergences only at near-ties", str(result["logprobs_close"]))
    if "rule" in result:
        table.add_row("rule", result["rule"])
    for label, block in (("exact", result.get("distribution")), ("fast", result.get("fast", {}).get("distribution"))):
        if block:
            table.add_row(
                f"{label}: KL(transformers‖engine) ÷ the one-ulp floor",
                f"{block['kl_transformers_engine']:.2e} ÷ {block['kl_transformers_floor']:.4f}"
                f" = {block['kl_ratio']:.4f}",
            )
            table.add_row(
                f"{label}: KL(source‖engine) against KL(source‖transformers)",
                f"{block['kl_source_engine']:.4f}, {100 * block['damage_diff']:.2f} % apart"
                f" beyond a one-ulp move's {100 * block.get('damage_floor', 0.0):.2f} %",
            )
    if "layerwise" in result:
        layerwise = result["layerwise"]
        worst = max(layerwise["layers"] + [layerwise["head"]], key=lambda e: e["floor_ratio"])
        table.add_row("layerwise: worst error ÷ its floor", f"{worst['floor_ratio']:.2f} ({worst['layer']})")
    if "index_sets" in result:
        sets = result["index_sets"]
        table.add_row("DSA: same selected keys", f"{sets['equal']}/{sets['positions']} positions")
    if "fast" in result:
        fast = result["fast"]
        if "max_abs_logprob_diff" in fast:
            table.add_row("fast numerics, decode: max |Δ logprob|", f"{fast['max_abs_logprob_diff']:.4f}")
            table.add_row(
                "fast numerics, decode: same top token",
                f"{100 * fast['top1_agreement']:.2f} % (exact {100 * fast['exact_top1_agreement']:.2f} %)",
            )
        table.add_row("fast numerics: identical greedy", f"{100 * fast['greedy_match_rate']:.1f} %")
        if fast.get("decision_tie_prompts"):
            table.add_row("fast numerics: parted at a decision tie", f"{fast['decision_tie_prompts']} prompts")
        table.add_row("fast numerics: near-ties only", str(fast["logprobs_close"]))
    return table


def adapt_plan(shape: ModelShape, budget: int) -> StagePlan:
    """Whole-model parity holds transformers' model and the engine's; streamed is `--layerwise`."""
    return plan_stage("adapt", shape, budget, 4096)


def run_adapt(
    run: RunDir, checkpoint: Checkpoint, device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    console.print(f"{', '.join(checkpoint.architectures)} -> engine model {engine_model_for(checkpoint)}")
    source = None
    if Path(checkpoint.path).resolve() == run.artifact.resolve() and run.source is not None:
        source = inspect_checkpoint(run.source)
    num_prompts = run.recipe().adapt.num_prompts

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        result = measure_parity(checkpoint, dtype, device, num_prompts, source=source)
        atomic.write_json(stage.path(PARITY), result)
        return {k: v for k, v in result.items() if k not in ("cases", "layerwise")}

    inputs = {"model": fingerprint(checkpoint.path), "dtype": str(dtype), "device": device, "num_prompts": num_prompts}
    if source is not None:
        inputs["source"] = fingerprint(source.path)
    entry = run.run_stage("adapt", inputs, outputs=[PARITY], body=body)
    console.print(parity_table(json.loads(run.path(PARITY).read_text())))
    return entry


def run_layerwise(
    run: RunDir, checkpoint: Checkpoint, device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """`adapt --layerwise`: decoder layers compared one at a time (adapt/layerwise.json)."""
    from onboard.adapt.layerwise import measure_layerwise

    console.print(
        f"{', '.join(checkpoint.architectures)} -> engine model {engine_model_for(checkpoint)}, layer by layer"
    )
    prompts = parity_prompts(load_tokenizer(checkpoint), run.recipe().adapt.num_prompts)

    def body(stage: Stage) -> dict[str, Any]:
        result = measure_layerwise(checkpoint.path, prompts, dtype, device)
        atomic.write_json(stage.path(LAYERWISE), result)
        return {
            k: result[k] for k in ("passed", "max_abs_diff", "max_floor_ratio", "first_failing_layer", "num_tokens")
        }

    inputs = {"model": fingerprint(checkpoint.path), "dtype": str(dtype), "device": device, "num_prompts": len(prompts)}
    entry = run.run_stage("adapt_layerwise", inputs, outputs=[LAYERWISE], body=body)
    console.print(layerwise_table(entry["metrics"], run.path(LAYERWISE)))
    return entry


def layerwise_table(metrics: dict[str, Any], path: Path) -> Table:
    table = Table(title="engine against transformers, one decoder layer at a time", title_justify="left")
    for column in ("layer", "max |Δ|", "RMS error", "floor RMS", "÷ floor", "passed"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    result = json.loads(path.read_text())
    for entry in [*result["layers"], result["head"]]:
        passed = "yes" if entry["passed"] else "[red]NO[/red]"
        cells = (entry["max_abs_diff"], entry["error_rms"], entry["floor_rms"], entry["floor_ratio"])
        table.add_row(entry["layer"], *(f"{v:.3g}" for v in cells), passed)
    if metrics["first_failing_layer"]:
        table.caption = f"first failing: {metrics['first_failing_layer']}"
    return table


def resolve_target(path: Path, out: Path | None) -> tuple[Path, Path]:
    """(checkpoint, run directory) for PATH being a run directory or a plain checkpoint."""
    if is_run(path):
        run = RunDir(path)
        if not (run.artifact / "config.json").is_file():
            raise OnboardError(f"{path} has no artifact; run `onboard quantize` first")
        return run.artifact, out or path
    if out is None:
        raise OnboardError(f"{path} is a checkpoint, not a run directory: pass --out DIR for the results")
    return path, out


def plan(ctx: StageContext) -> StagePlan:
    if ctx.skip_adapt:
        lacks = engine_refusal(ctx.checkpoint)
        return skipped("adapt", "--skip-adapt: the adaptation proof is missing" + (f" ({lacks})" if lacks else ""))
    require_engine(ctx, "adapt")
    return adapt_plan(ctx.shape, ctx.budget)


def run(run_dir: RunDir, ctx: StageContext) -> StageResult:
    """The artifact against its source: whole models, or one decoder layer at a time over the budget."""
    run_dir.require("quantize")
    streamed = plan(ctx).path == "streamed"
    return (run_layerwise if streamed else run_adapt)(run_dir, inspect_checkpoint(run_dir.artifact), ctx.device)
