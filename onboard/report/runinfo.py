"""Run-level facts: the header line, stage timings, package versions, and the throughput card."""

import re
from pathlib import PurePath
from typing import Any

from onboard.report import svg
from onboard.report.fmt import is_num, secs
from onboard.report.load import STAGES, Run, as_dict
from onboard.workspace import BENCH

# `onboard bench`'s sides, as `{side}_c{N}_tps` keys of bench/bench.json, in column order.
BENCH_SIDES = (
    ("hf", "transformers"),
    ("engine_exact", "engine exact"),
    ("engine_fast", "engine fast"),
    ("engine_fast_noninvariant", "engine fast, not batch invariant"),
    ("llama_cpp", "llama.cpp"),
)
BENCH_KEY = re.compile(r"^(?P<side>" + "|".join(side for side, _ in BENCH_SIDES) + r")_c(?P<n>\d+)_tps$")
BENCH_RATIO = re.compile(r"^fast(_noninvariant)?_over_(hf|llama_cpp)_c\d+$")


def header(run: Run) -> dict[str, Any]:
    manifest = run.manifest or {}
    recipe = as_dict(manifest.get("recipe"))
    inputs = as_dict(run.stage("quantize").get("inputs"))
    model_path = inputs.get("model_path") or inputs.get("model")
    model = PurePath(str(model_path)).name if isinstance(model_path, str) and "/" in model_path else None
    finished = sorted(str(s["finished"]) for s in run.stages.values() if s.get("finished"))
    return {
        "model": model or run.dir.resolve().name,
        "run_dir": manifest.get("run_dir") or run.dir.name,
        "recipe": recipe.get("name"),
        "description": recipe.get("description"),
        "created": manifest.get("created"),
        "updated": finished[-1] if finished else None,
        "has_manifest": run.manifest is not None,
    }


def stages(run: Run) -> dict[str, Any]:
    names = list(STAGES) + sorted(set(run.stages) - set(STAGES))
    rows = []
    for name in names:
        info = run.stage(name)
        rows.append(
            {
                "name": name,
                "status": info.get("status") or "not run",
                "seconds": info.get("seconds"),
                "started": info.get("started"),
                "finished": info.get("finished"),
                "error": info.get("error"),
            }
        )
    timed = [r for r in rows if is_num(r["seconds"])]
    chart = None
    if timed:
        chart = svg.bar_chart(
            [r["name"] for r in timed],
            [r["seconds"] for r in timed],
            width=540,
            fmt=secs,
            title="stage wall time",
        )
    total = sum(r["seconds"] for r in timed)
    return {"rows": rows, "chart": chart, "total": total if timed else None}


def versions(run: Run) -> dict[str, Any]:
    return {str(k): v for k, v in as_dict((run.manifest or {}).get("versions")).items()}


def bench(run: Run) -> dict[str, Any]:
    data = run.json(BENCH)
    smoke_stage = as_dict(as_dict((run.manifest or {}).get("stages")).get("smoke"))
    throughput = {str(k): v for k, v in as_dict(as_dict(smoke_stage.get("metrics")).get("throughput")).items()}
    result = data or {}
    levels = sorted({int(m["n"]) for key in result if (m := BENCH_KEY.match(key))})
    rows = []
    for n in levels:
        tps = {side: result.get(f"{side}_c{n}_tps") for side, _ in BENCH_SIDES}
        fast = tps["engine_fast"]
        rows.append(
            {
                "concurrency": n,
                "tps": [tps[side] for side, _ in BENCH_SIDES],
                "fast_over_hf": _ratio(fast, tps["hf"]),
                "fast_over_llama_cpp": _ratio(fast, tps["llama_cpp"]),
            }
        )
    used = {"model", "concurrency", "llama_cpp_skipped"}
    other = {
        k: v
        for k, v in result.items()
        if k not in used and not BENCH_KEY.match(k) and not BENCH_RATIO.match(k) and not isinstance(v, dict | list)
    }
    present = data is not None or bool(throughput)
    return {
        "status": "done" if present else "not run",
        "present": present,
        "error": None,
        "model": result.get("model"),
        "columns": [label for _, label in BENCH_SIDES],
        "rows": rows,
        "llama_cpp_skipped": result.get("llama_cpp_skipped"),
        "other": other,
        "throughput": throughput,
    }


def _ratio(mine: Any, theirs: Any) -> float | None:
    return mine / theirs if is_num(mine) and is_num(theirs) and theirs else None
