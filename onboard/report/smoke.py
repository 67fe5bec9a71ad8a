"""The generation smoke-test card: detector rates artifact vs reference, batch invariance, and the
worst examples side by side with the detected loop highlighted."""

from typing import Any

from onboard.report import svg
from onboard.report.fmt import is_num, pct
from onboard.report.load import Run, as_dict, as_list, section
from onboard.workspace import SMOKE

MAX_CASES = 6
MAX_DIVERGED = 10


def split_loop(text: Any, loop: Any) -> dict[str, Any]:
    """The text cut where its loop starts: the template escapes both parts and wraps `loop` in
    <mark>. No loop (or an offset that does not fit the text) leaves everything in `before`."""
    text = "" if text is None else str(text)
    start = as_dict(loop).get("char_start")
    if isinstance(start, int) and not isinstance(start, bool) and 0 <= start < len(text):
        return {"before": text[:start], "loop": text[start:], "info": as_dict(loop)}
    return {"before": text, "loop": "", "info": None}


def detectors(smoke: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    rows = [as_dict(d) for d in as_list(smoke.get("detectors"))]
    rates = [r for r in rows if str(r.get("key", "")).endswith("_rate")]
    rates = [r for r in rates if is_num(r.get("artifact")) or is_num(r.get("reference"))]
    chart = None
    if rates:
        chart = svg.grouped_bars(
            [r.get("name", r.get("key")) for r in rates],
            [
                ("artifact", [r.get("artifact") for r in rates], svg.BLUE),
                ("reference", [r.get("reference") for r in rates], svg.GREY),
            ],
            width=540,
            fmt=pct,
            title="detector rates, artifact vs reference",
        )
    return rows, chart


def by_mode(smoke: dict[str, Any]) -> dict[str, Any] | None:
    modes = {str(k): as_dict(v) for k, v in as_dict(smoke.get("by_mode")).items()}
    if not modes:
        return None
    keys: list[str] = []
    for values in modes.values():
        keys += [k for k in values if k not in keys and not isinstance(values[k], dict | list)]
    return {"modes": list(modes), "rows": [[k, *(modes[m].get(k) for m in modes)] for k in keys]}


def cases(smoke: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    all_cases = [as_dict(c) for c in as_list(smoke.get("cases"))]
    shown = []
    for case in all_cases[:MAX_CASES]:
        shown.append(
            {
                **case,
                "artifact": split_loop(case.get("artifact_text"), case.get("artifact_loop")),
                "reference": split_loop(case.get("reference_text"), case.get("reference_loop")),
            }
        )
    return shown, len(all_cases) - len(shown)


def build(run: Run) -> dict[str, Any]:
    smoke = run.json(SMOKE)
    data = smoke or {}
    rows, chart = detectors(data)
    shown, hidden = cases(data)
    invariance = as_dict(data.get("invariance"))
    diverged = [as_dict(d) for d in as_list(invariance.get("diverged"))]
    return section(
        run,
        "smoke",
        smoke,
        smoke=data,
        detectors=rows,
        detector_chart=chart,
        by_mode=by_mode(data),
        invariance=invariance,
        diverged=diverged[:MAX_DIVERGED],
        diverged_hidden=max(len(diverged) - MAX_DIVERGED, 0),
        cases=shown,
        cases_hidden=hidden,
    )
