"""`onboard bench-quant`: uniform NVFP4, GPTQ, fixed rules, the additive and the searched selection,
all scored in one run on the same held-out text (never the calibration text they were fitted on)."""

import copy
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard import atomic
from onboard.console import console
from onboard.evaluate.stage import eval_windows, measure_kl
from onboard.models import Checkpoint, load_model, load_tokenizer
from onboard.quantize.auto import Selection
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.compose import Composer
from onboard.quantize.groups import ATTENTION_KINDS, Group, effective_bits
from onboard.quantize.modifiers import quantized_copy
from onboard.recipes import Recipe

METHODS = (
    "uniform_nvfp4",
    "uniform_nvfp4_gptq",
    "heuristic_attn_fp8",
    "heuristic_down_fp8",
    "heuristic_ends_bf16",
    "additive",
    "search",
)


def heuristics(groups: list[Group], base: str) -> dict[str, dict[str, str]]:
    """The one-line rules people use: attention in FP8, down_proj in FP8, first and last two
    decoder layers in BF16; everything else in the base format."""
    last = max(g.layer for g in groups if g.layer is not None)

    def rule(pick) -> dict[str, str]:
        return {g.name: pick(g) or base for g in groups}

    return {
        "heuristic_attn_fp8": rule(lambda g: "fp8" if g.kind in ATTENTION_KINDS else None),
        "heuristic_down_fp8": rule(lambda g: "fp8" if g.kind == "down_proj" else None),
        "heuristic_ends_bf16": rule(lambda g: "bf16" if g.layer in (0, 1, last - 1, last) else None),
    }


def run_bench_quant(
    checkpoint: Checkpoint, recipe: Recipe, budgets: list[float], calib: Path | None, data: Path | None, out: Path
) -> dict[str, Any]:
    settings = recipe.quantize.model_copy(update={"scheme": "nvfp4", "bits_budget": None, "base": "nvfp4"})
    torch.manual_seed(0)
    tokenizer = load_tokenizer(checkpoint)
    model = load_model(checkpoint)
    reference = copy.deepcopy(model)
    dataset = calibration_dataset(tokenizer, settings.calibration, calib)
    windows = eval_windows(tokenizer, recipe.eval, data)
    rows: list[dict[str, Any]] = []

    def score(method: str, candidate, budget: float, bits: float, seconds: float, **extra) -> None:
        console.print(f"[bold]{method}[/] at {bits:.3f} bits: scoring on held-out text")
        stats = measure_kl(reference, candidate, windows)["all"].summary()
        row = {
            "method": method,
            "budget": budget,
            "effective_bits": round(bits, 4),
            "mean_kld": stats["mean_kld"],
            "top1_agreement": stats["top1_agreement"],
            "seconds": round(seconds, 1),
            **extra,
        }
        rows.append(row)
        console.print(f"  mean KLD {row['mean_kld']:.4f}, same top token {100 * row['top1_agreement']:.1f} %")

    selection = Selection(model, tokenizer, settings, dataset, budgets)
    groups, composer = selection.groups, selection.composer
    shared = selection.seconds
    uniform = selection.uniform()
    uniform_bits = effective_bits(groups, uniform)
    composer.apply(uniform)
    score("uniform_nvfp4", model, round(uniform_bits, 4), uniform_bits, shared["source:nvfp4"])

    clock = time.perf_counter()
    gptq = quantized_copy(reference, tokenizer, settings.model_copy(update={"algorithm": "gptq"}), "nvfp4", dataset)
    seconds = time.perf_counter() - clock
    composer.reset()
    Composer(model, {"nvfp4": gptq}, groups).apply(uniform)
    score("uniform_nvfp4_gptq", model, round(uniform_bits, 4), uniform_bits, seconds)
    del gptq

    for method, assignment in heuristics(groups, settings.base).items():
        bits = effective_bits(groups, assignment)
        composer.apply(assignment)
        score(method, model, round(bits, 4), bits, shared["sources"])

    for budget in budgets:
        final, record = selection.select(budget, settings.search.steps)
        additive = {**uniform, **record["additive"]["upgraded"]}
        ready = record["seconds"]
        before_search = ready["sources"] + ready["sensitivity"] + ready["fisher"]
        for method, assignment, seconds, part in (
            ("additive", additive, before_search, record["additive"]),
            ("search", final, before_search + ready["search"], record["final"]),
        ):
            composer.apply(assignment)
            upgraded = {g: f for g, f in assignment.items() if f != settings.base}
            score(
                method,
                model,
                budget,
                effective_bits(groups, assignment),
                seconds,
                calibration_kld=part["measured_kld"],
                upgraded=upgraded,
            )
    composer.reset()
    result = {
        "model": str(checkpoint.path),
        "data": str(data) if data else "builtin:eval",
        "calibration": str(calib) if calib else "builtin:calib",
        "heldout_tokens": sum(len(w) - 1 for _, w in windows),
        "search_tokens": selection.replay.num_tokens,
        "search_steps": settings.search.steps,
        "rank_correlation": record["sensitivity"]["rank_correlation"] if budgets else None,
        "rows": rows,
    }
    atomic.write_json(out, result)
    console.print(bench_table(rows))
    return result


def bench_table(rows: list[dict[str, Any]]) -> Table:
    uniform = next((r["mean_kld"] for r in rows if r["method"] == "uniform_nvfp4"), None)
    table = Table(title="held-out KL by selection method", title_justify="left")
    for column in ("method", "budget", "bits", "KLD", "× unif", "top-1", "s"):
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row["method"],
            f"{row['budget']:.2f}",
            f"{row['effective_bits']:.3f}",
            f"{row['mean_kld']:.4f}",
            f"{row['mean_kld'] / uniform:.2f}" if uniform else "-",
            f"{100 * row['top1_agreement']:.1f} %",
            f"{row['seconds']:.0f}",
        )
    return table
