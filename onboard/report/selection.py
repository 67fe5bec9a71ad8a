"""The `scheme: auto` part of the quantization card: budget, groups kept above the base format,
measured against Fisher sensitivities, and the search trace."""

from typing import Any

from onboard.report import svg
from onboard.report.fmt import MISSING, is_num, num, pct
from onboard.report.load import as_dict, as_list

FORMAT_COLORS = {"nvfp4": "#2563eb", "nvfp4a16": "#0d9488", "fp8": "#f59e0b", "bf16": "#94a3b8"}
OTHER_COLORS = ("#a855f7", "#ec4899", "#84cc16", "#64748b")
GREEN = "#16a34a"
AUTO_KEYS = ("base", "bits_budget", "groups", "sensitivity", "additive", "final")
TRACE_NUMBERS = ("step", "effective_bits", "mean_kld", "best_kld", "predicted_change")
TOP_SENSITIVE = 12


def format_colors(formats: list[str]) -> dict[str, str]:
    """A fixed colour per known format; the rest get the spare colours in sorted order."""
    colors = {f: FORMAT_COLORS[f] for f in formats if f in FORMAT_COLORS}
    spare = iter(OTHER_COLORS * (1 + len(formats) // len(OTHER_COLORS)))
    for f in sorted(set(formats) - set(colors)):
        colors[f] = next(spare)
    return colors


def _n(value: Any) -> Any:
    """A number, or None for anything else (a string must not pass for a measurement)."""
    return value if is_num(value) else None


def _num(value: Any) -> str:
    return num(value) if is_num(value) else MISSING


def _int(value: Any) -> int | None:
    return int(value) if is_num(value) and value == int(value) else None


def pinned_summary(pinned: Any) -> str | None:
    """The recipe `formats:` block as counts: {"fp8": [3 patterns], "bf16": [1]} -> "3 fp8 · 1 bf16"."""
    parts = [f"{len(p)} {f}" for f, p in sorted(as_dict(pinned).items()) if isinstance(p, list) and p]
    return " · ".join(parts) or None


def _summary(step: Any) -> str:
    """One line for the `additive` / `final` record of an auto selection."""
    step = as_dict(step)
    if not step:
        return MISSING
    upgraded = as_dict(step.get("upgraded"))
    return (
        f"measured KLD {_num(step.get('measured_kld'))} (predicted {_num(step.get('predicted_kld'))})"
        f" · {_num(step.get('effective_bits'))} bits · {len(upgraded)} groups upgraded"
    )


def upgraded_groups(
    sel: dict[str, Any], base: str | None, measured: dict[str, Any], fisher: dict[str, Any]
) -> tuple[list[dict[str, Any]], int | None, float | None]:
    """The groups kept above the base format, most sensitive (in the base format) first; the
    number of groups (None when unknown); the share of the groups' weights kept above the base."""
    groups = [g for g in as_list(sel.get("groups")) if isinstance(g, dict)]
    count = len(groups) or None
    if not groups:  # no group list: the final assignment still names the upgraded groups
        upgraded = as_dict(as_dict(sel.get("final")).get("upgraded"))
        groups = [{"name": name, "format": fmt} for name, fmt in upgraded.items()]
    if base is None:
        return [], count, None
    rows = []
    for group in groups:
        name, fmt = str(group.get("name", "?")), group.get("format")
        if not isinstance(fmt, str) or fmt == base:
            continue
        sens, est = as_dict(measured.get(name)), as_dict(fisher.get(name))
        rows.append(
            {
                "name": name,
                "layer": _int(group.get("layer")),
                "format": fmt,
                "weights": _n(group.get("weights")),
                "bits": _n(as_dict(group.get("bits")).get(fmt)),
                "measured_base": _n(sens.get(base)),
                "fisher_base": _n(est.get(base)),
                "measured_format": _n(sens.get(fmt)),
            }
        )
    rows.sort(key=lambda r: (r["measured_base"] is None, -(r["measured_base"] or 0), r["name"]))
    weights = [g.get("weights") for g in groups]
    total = sum(w for w in weights if is_num(w))
    kept = sum(r["weights"] for r in rows if r["weights"] is not None)
    return rows, count, (kept / total if count and total and all(is_num(w) for w in weights) else None)


def sensitivity_chart(base: str | None, measured: dict[str, Any], fisher: dict[str, Any]) -> Any:
    """The most sensitive groups in the base format: measured KL beside the Fisher estimate."""
    if base is None:
        return None
    values = {str(g): _n(as_dict(per).get(base)) for g, per in measured.items()}
    ranked = sorted(((g, v) for g, v in values.items() if v is not None), key=lambda gv: (-gv[1], gv[0]))
    if not ranked:
        return None
    names = [g for g, _ in ranked[:TOP_SENSITIVE]]
    estimates = [_n(as_dict(fisher.get(g)).get(base)) for g in names]
    series = [("measured", [v for _, v in ranked[:TOP_SENSITIVE]], svg.BLUE)]
    if any(e is not None for e in estimates):
        series.append(("Fisher estimate", estimates, "#f59e0b"))
    return svg.grouped_bars(names, series, width=560, title=f"sensitivity in {base}, measured vs Fisher")


def _ladder(formats: list[str]) -> Any:
    """Sort key for (format, value) items: the ladder's order (base first), then the rest by name."""
    return lambda item: (formats.index(item[0]) if item[0] in formats else len(formats), str(item[0]))


def auto_selection(sel: dict[str, Any]) -> dict[str, Any] | None:
    """The `scheme: auto` part of selection.json, or None for a fixed scheme."""
    if not any(k in sel for k in AUTO_KEYS):
        return None
    formats = [f for f in as_list(sel.get("formats")) if isinstance(f, str)]
    base = sel.get("base") if isinstance(sel.get("base"), str) else (formats[0] if formats else None)
    sensitivity = as_dict(sel.get("sensitivity"))
    measured, fisher = as_dict(sensitivity.get("measured")), as_dict(sensitivity.get("fisher"))
    rows, count, share = upgraded_groups(sel, base, measured, fisher)
    colors = format_colors(sorted({*formats, *(r["format"] for r in rows)}))
    for row in rows:
        row["color"] = colors[row["format"]]
    rho = as_dict(sensitivity.get("rank_correlation"))
    kept = (
        f"{len(rows)} of {count} groups" if count else f"{len(rows)} group{'s' * (len(rows) != 1)}" if rows else MISSING
    )
    if share is not None:
        kept += f" ({pct(share)} of their weights)"
    facts = [
        ("base format · ladder", f"{base or MISSING} · {' → '.join(formats) or MISSING}"),
        ("bits budget (per quantizable weight)", _num(sel.get("bits_budget"))),
        ("search tokens · steps", f"{_num(sel.get('search_tokens'))} · {_num(sel.get('search_steps'))}"),
        ("additive start (calibration text)", _summary(sel.get("additive"))),
        ("after the search (calibration text)", _summary(sel.get("final"))),
        ("artifact KLD (same tokens)", _num(sel.get("artifact_kld"))),
        (
            "rank correlation, measured vs Fisher",
            " · ".join(f"{f} {_num(v)}" for f, v in sorted(rho.items(), key=_ladder(formats))) or MISSING,
        ),
        (f"kept above {base or 'the base format'}", kept),
    ]
    return {
        "base": base,
        "facts": facts,
        "groups": rows,
        "sensitivity_chart": sensitivity_chart(base, measured, fisher),
    }


def _trace_value(key: str, value: Any) -> Any:
    """A trace cell: known numbers must be numbers, `accepted` a bool; anything else as written."""
    if key in TRACE_NUMBERS:
        return _n(value)
    if key == "accepted":
        return value if isinstance(value, bool) else None
    return value


def search_trace(search: list[Any]) -> dict[str, Any] | None:
    """The trace table (accepted steps marked) and a chart: measured and best KLD per search step
    when the steps are numbered, else (an older trace) mean KLD against effective bits."""
    steps = [s for s in search if isinstance(s, dict)]
    if not steps:
        return None
    keys: list[str] = []
    for step in steps:
        keys += [k for k in step if k not in keys]
    chart = None
    if any(is_num(s.get("step")) for s in steps) and ("mean_kld" in keys or "best_kld" in keys):
        xs = [s.get("step") for s in steps]
        lines = (("mean_kld", "measured KLD", svg.BLUE), ("best_kld", "best KLD so far", GREEN))
        chart = svg.line_chart(
            [(name, xs, [s.get(k) for s in steps], color) for k, name, color in lines if k in keys],
            width=760,
            x_label="search step",
            y_label="KLD",
            title="selection trace",
        )
    elif "mean_kld" in keys and "effective_bits" in keys:
        xs = [s.get("effective_bits") for s in steps]
        ys = [s.get("mean_kld") for s in steps]
        chart = svg.line_chart(
            [("mean KLD", xs, ys, svg.BLUE)], x_label="effective bits", y_label="mean KLD", title="selection trace"
        )
    rows = [
        {
            "cells": [(k, _trace_value(k, s.get(k))) for k in keys],
            "accepted": s.get("accepted") is True,
        }
        for s in steps
    ]
    return {"keys": keys, "rows": rows, "chart": chart, "accepted": sum(r["accepted"] for r in rows)}
