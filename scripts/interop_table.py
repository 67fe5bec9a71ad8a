"""The tables of `make interop` (docs/benchmarks.md) from runs/interop/results/*.json.

.venv/bin/python scripts/interop_table.py runs/interop/results
"""

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def kl_table(results: Path) -> list[str]:
    columns = [
        ("in-process", "inprocess"),
        ("onboard serve top-20", "onboard-k20"),
        ("onboard serve full", "onboard-k-1"),
        ("vLLM CPU top-20", "vllm-k20"),
        ("vLLM CPU full", "vllm-k-1"),
    ]
    lines = [
        "| artifact | " + " | ".join(label for label, _ in columns) + " |",
        "| --- |" + " --- |" * len(columns),
    ]
    for name in ("fp8", "w4a4", "mixed"):
        cells = []
        for _, suffix in columns:
            found = _load(results / f"eval-{name}-{suffix}.json")
            cells.append("—" if found is None else f"{found['mean_kld']:.4f} ({100 * found['top1_agreement']:.1f} %)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def smoke_table(results: Path) -> list[str]:
    lines = [
        "| served by vLLM CPU | loops | reference loops | run-ons | hit max_tokens | distinct-2 | batch invariant |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("bf16", "fp8"):
        found = _load(results / f"smoke-{name}-vllm.json")
        if found is None:
            continue
        invariance = found["invariance"]
        parted: dict[str, list[int]] = {}
        for d in invariance["diverged"]:
            parted.setdefault(d["composition"], []).append(d["first_divergence"])
        verdict = (
            "yes"
            if found["batch_invariant"]
            else "no: "
            + "; ".join(
                f"{len(at)} of {invariance['prompts']} parted {where} (first at tokens {min(at)}-{max(at)})"
                for where, at in parted.items()
            )
        )
        lines.append(
            f"| {name} | {found['loop_rate']:.3f} | {found['reference_loop_rate']:.3f} | {found['run_on_rate']:.3f} "
            f"| {found['no_eos_rate']:.3f} | {found['distinct_2']:.3f} | {verdict} |"
        )
    return lines


def bench_table(results: Path) -> list[str]:
    found = _load(results / "bench-bf16.json")
    if found is None:
        return []
    lines = [
        "| server | concurrency | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {e["url"]: e["url"] for e in found["endpoints"]}
    for level in found["levels"]:
        ttft, itl, tpot = level["ttft_ms"], level["itl_ms"], level["tpot_ms"]
        lines.append(
            f"| {names.get(level['endpoint'], level['endpoint'])} | {level['concurrency']} "
            f"| {level['output_tokens_per_s']:.1f} | {level['requests_per_s']:.2f} "
            f"| {ttft['p50']:.0f} / {ttft['p99']:.0f} | {itl['p50']:.0f} / {itl['p99']:.0f} | {tpot['p50']:.0f} |"
        )
    return lines


def acceptance_table(results: Path) -> list[str]:
    lines = ["| engine | acceptance length | per position | drafts | by traffic |", "| --- | --- | --- | --- | --- |"]
    for label, name in (("onboard serve", "onboard"), ("vLLM CPU", "vllm")):
        found = _load(results / f"acceptance-{name}.json")
        if found is None:
            refusal = results / f"acceptance-{name}-refusal.txt"
            if refusal.is_file():
                lines.append(f"| {label} | refused: {refusal.read_text().strip()} | | | |")
            continue
        positions = ", ".join(f"{p:.2f}" for p in found["per_position_acceptance"])
        traffic = ", ".join(f"{k} {v['acceptance_length']:.2f}" for k, v in found["by_traffic"].items())
        lines.append(
            f"| {label} | {found['acceptance_length']:.3f} | {positions} | {found['num_drafts']} | {traffic} |"
        )
    return lines


def main(results: Path) -> None:
    for title, table in (
        ("mean KLD (same top token)", kl_table(results)),
        ("smoke against vLLM CPU, reference = onboard's engine on the bf16 checkpoint", smoke_table(results)),
        ("bench: the same bf16 checkpoint behind both servers", bench_table(results)),
        ("speculator acceptance, same draft, same held-out prompts", acceptance_table(results)),
    ):
        if len(table) > 2:
            print(f"\n{title}\n")
            print("\n".join(table))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/interop/results"))
