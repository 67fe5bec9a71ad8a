"""Run-level facts: the header line, stage timings, package versions, and the throughput card."""

from pathlib import PurePath
from typing import Any

from onboard.report import svg
from onboard.report.fmt import is_num, secs
from onboard.report.load import STAGES, Run, as_dict

BENCH_PAIRS = (
    ("tokens/s, concurrency 1", "engine_c1_tps", "hf_c1_tps"),
    ("tokens/s, concurrency 16", "engine_c16_tps", "hf_c16_tps"),
)


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
    data = run.json("bench/bench.json")
    smoke_stage = as_dict(as_dict((run.manifest or {}).get("stages")).get("smoke"))
    throughput = {str(k): v for k, v in as_dict(as_dict(smoke_stage.get("metrics")).get("throughput")).items()}
    result = data or {}
    pairs = []
    used = {"model"}
    for name, engine_key, hf_key in BENCH_PAIRS:
        if engine_key in result or hf_key in result:
            engine, hf = result.get(engine_key), result.get(hf_key)
            speedup = engine / hf if is_num(engine) and is_num(hf) and hf else None
            pairs.append({"name": name, "engine": engine, "hf": hf, "speedup": speedup})
            used |= {engine_key, hf_key}
    other = {k: v for k, v in result.items() if k not in used and not isinstance(v, dict | list)}
    present = data is not None or bool(throughput)
    return {
        "status": "done" if present else "not run",
        "present": present,
        "error": None,
        "model": result.get("model"),
        "pairs": pairs,
        "other": other,
        "throughput": throughput,
    }
