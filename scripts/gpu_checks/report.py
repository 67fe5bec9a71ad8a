"""The report on the console: the throughput, parity, artifact, speculative-decoding and phase
tables of the JSON report."""

from __future__ import annotations

from typing import Any


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value and abs(value) < 1e-3:
            return f"{value:.{max(digits, 1)}g}"
        text = f"{value:,.{digits}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    return str(value)


def print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    env = report["environment"]
    model = report.get("model") or {}
    console.print(
        f"gpu_check: shape {report['settings']['shape']} on {env.get('gpu', env['device'])}, "
        f"{_num(model.get('parameters', 0) / 1e6, 1)}M parameters, "
        f"torch {env['torch']}, transformers {env['transformers']}"
    )

    table = Table(title="throughput (engine fast numerics vs transformers.generate, bf16, greedy)")
    for col in ("concurrency", "engine tok/s", "HF tok/s", "ratio", "same outputs", "preemptions"):
        table.add_column(col, justify="right")
    for row in (report.get("throughput") or {}).get("results", []):
        table.add_row(
            str(row["concurrency"]),
            f"{row['engine_tps']:,.1f}",
            f"{row['hf_tps']:,.1f}",
            f"{row['ratio']:.2f}x",
            f"{row['same_greedy_outputs']:.2f}",
            str(row["engine_preemptions"]),
        )
    console.print(table)

    table = Table(title="parity (engine exact numerics vs transformers, one prompt at a time; artifacts in bf16)")
    for col in ("weights", "rule", "max |Δ logit|", "bitwise", "top-1", "mean KL", "greedy", "ties only", "matched"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in report["parity"].values():
        if row and "max_abs_logit_diff" in row:  # distillation has its line in the artifacts' table
            dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(row["dtype"], row["dtype"])
            table.add_row(
                row["checkpoint"].removesuffix(" artifact") if "checkpoint" in row else f"model {dtype}",
                row["rule"],
                _num(row["max_abs_logit_diff"]),
                _num(row["bitwise_equal_logits"]),
                _num(row["top1_agreement"]),
                _num(row["mean_kld"]),
                _num(row["greedy_match_rate"]),
                _num(row["divergences_all_near_ties"]),
                f"{row['mean_matched_tokens']:.1f}/{row['greedy_tokens']}",
            )
    console.print(table)

    artifacts = {k: row for k, row in report["parity"].items() if row and "quantize" in row}
    if artifacts:
        table = Table(title="artifacts (the random model through onboard's quantize stage) and their rules")
        for col in ("scheme", "quantize s", "bits/weight", "GiB", "calib tokens", "rule", "passed", "failures"):
            table.add_column(col, justify="right")
        for name, row in artifacts.items():
            q = row["quantize"]
            table.add_row(
                name,
                _num(q["quantize_s"], 1),
                _num(q["effective_bits"], 2),
                _num(q["artifact_bytes"] / 2**30, 3),
                _num(q["calibration_tokens"]),
                row["rule"],
                _num(row["passed"]),
                "; ".join(row["failures"]) or "-",
            )
        console.print(table)
    distill = (report["parity"].get("distill") or {}).get("distill")
    if distill:
        console.print(
            f"distill: {distill['tokens']} tokens, {distill['steps']} steps in {distill['seconds']} s; held-back KL "
            f"{distill['held_back_kld_before']:.4f} -> {distill['held_back_kld_after']:.4f}, "
            + (f"epoch {distill['best_epoch']} kept" if distill["kept"] else "not kept")
        )

    nvfp4 = report["parity"].get("nvfp4")
    if nvfp4:
        limits, sides, layerwise = nvfp4["thresholds"], nvfp4["distribution"], nvfp4["layerwise"]
        table = Table(title="nvfp4 W4A4: the layerwise-distribution rule (source: the bf16 model)")
        for col in ("check", "exact", "fast", "limit"):
            table.add_column(col, justify="right")
        table.add_row(
            "KL(transformers‖engine)",
            _num(sides["exact"]["kl_transformers_engine"]),
            _num(sides["fast"]["kl_transformers_engine"]),
            "",
        )
        table.add_row("KL(source‖transformers)", _num(sides["exact"]["kl_source_transformers"]), "", "")
        table.add_row(
            "kl_ratio",
            _num(sides["exact"]["kl_ratio"]),
            _num(sides["fast"]["kl_ratio"]),
            _num(limits["max_parity_kl_ratio"]),
        )
        table.add_row(
            "damage_diff (± s.e.)",
            f"{_num(sides['exact']['damage_diff'])} ± {_num(sides['exact']['damage_diff_se'])}",
            f"{_num(sides['fast']['damage_diff'])} ± {_num(sides['fast']['damage_diff_se'])}",
            _num(limits["max_parity_damage_diff"]),
        )
        table.add_row(
            "layerwise: worst layer ÷ its floor",
            _num(layerwise.get("max_floor_ratio")),
            "",
            _num(limits["max_parity_layer_ratio"]),
        )
        table.add_row(
            "layerwise: worst linear ÷ its rounding step",
            _num(layerwise.get("max_linear_ratio")),
            "",
            _num(limits["max_parity_linear_ratio"]),
        )
        if "error" in layerwise:
            table.add_row("layerwise: error", layerwise["error"][:60], "", "")
        console.print(table)

    table = Table(title="speculative decoding (random EAGLE-3 draft) vs plain greedy, bf16")
    for col in ("numerics", "k", "exact", "prompt match", "token match", "accept len"):
        table.add_column(col, justify="right")
    for name, row in report["spec"].items():
        if row:
            table.add_row(
                name,
                str(row["num_speculative_tokens"]),
                _num(row["exact"]),
                _num(row["prompt_match_rate"]),
                _num(row["token_match_rate"]),
                _num(row["acceptance_length"]),
            )
    console.print(table)

    table = Table(title=f"phases (total {report.get('total_s', 0):.1f} s)")
    for col in ("phase", "status", "elapsed s", "budget s", "peak GPU GiB"):
        table.add_column(col, justify="right")
    for name, row in report["phases"].items():
        status = row["status"] + (f": {row['error']}" if "error" in row else "")
        table.add_row(
            name,
            status[:60],
            _num(row.get("elapsed_s"), 1),
            _num(row["budget_s"], 0),
            _num(row.get("peak_gpu_memory_gib"), 1),
        )
    console.print(table)
