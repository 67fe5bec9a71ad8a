"""The model-facts and quantization cards: sizes, per-layer formats (heat map), and for
`scheme: auto` the selection (budget, groups kept above the base format, sensitivities) and its search trace."""

import re
from collections import Counter
from typing import Any

from onboard.report import svg
from onboard.report.fmt import is_num, ratio
from onboard.report.load import Run, as_dict, as_list, section
from onboard.report.selection import auto_selection, format_colors, pinned_summary, search_trace
from onboard.workspace import ARTIFACT, SELECTION

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
MIXED = "#ef4444"
LAYER_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")  # decoder layer index, and the module inside it


def format_heat_map(layers: dict[str, Any]) -> dict[str, Any] | None:
    """Rows = decoder layer index, columns = projection name, colour = format. Modules outside the
    decoder stack (embeddings, lm_head) are listed separately. Several modules landing in one cell
    (e.g. MoE experts) show as "mixed" when their formats differ."""
    grid: dict[tuple[int, str], list[tuple[str, str]]] = {}
    others: list[tuple[str, str]] = []
    for name, info in layers.items():
        fmt = str(as_dict(info).get("format", "?"))
        match = LAYER_MODULE.search(name)
        if match:
            grid.setdefault((int(match.group(1)), match.group(2).rsplit(".", 1)[-1]), []).append((name, fmt))
        else:
            others.append((name, fmt))
    if not grid and not others:
        return None
    formats = sorted({fmt for entries in grid.values() for _, fmt in entries} | {fmt for _, fmt in others})
    colors = format_colors(formats)
    seen_cols = {col for _, col in grid}
    cols = [p for p in PROJECTIONS if p in seen_cols] + sorted(seen_cols - set(PROJECTIONS))
    rows = sorted({index for index, _ in grid})
    cells = {}
    for (index, col), entries in grid.items():
        kinds = sorted({fmt for _, fmt in entries})
        color = colors[kinds[0]] if len(kinds) == 1 else MIXED
        tip = entries[0][0] + ": " + kinds[0] if len(entries) == 1 else f"{len(entries)} modules: {', '.join(kinds)}"
        cells[(str(index), col)] = (color, tip)
    legend = [(f, colors[f]) for f in formats]
    if any(color == MIXED for color, _ in cells.values()):
        legend.append(("mixed", MIXED))
    chart = svg.heat_map([str(r) for r in rows], cols, cells, legend=legend, title="format per layer") if rows else None
    return {
        "chart": chart,
        "others": [{"name": n, "format": f, "color": colors[f]} for n, f in sorted(others)],
    }


def format_table(layers: dict[str, Any]) -> list[dict[str, Any]]:
    """Per format: how many modules and what share of the weights."""
    modules: Counter[str] = Counter()
    weights: Counter[str] = Counter()
    for info in layers.values():
        info = as_dict(info)
        fmt = str(info.get("format", "?"))
        modules[fmt] += 1
        if is_num(info.get("weights")):
            weights[fmt] += info["weights"]
    total = sum(weights.values())
    colors = format_colors(list(modules))
    return [
        {
            "format": f,
            "modules": modules[f],
            "weights": weights[f],
            "share": weights[f] / total if total else None,
            "color": colors[f],
        }
        for f in sorted(modules, key=lambda f: (-weights[f], f))
    ]


def build(run: Run) -> dict[str, Any]:
    selection = run.json(SELECTION)
    config = run.json(f"{ARTIFACT}/config.json") or {}
    metrics = run.metrics("quantize")
    sel = selection or {}
    layers = as_dict(sel.get("layers"))
    archs = [str(a) for a in as_list(config.get("architectures"))]
    weights = sum(as_dict(v).get("weights", 0) for v in layers.values() if is_num(as_dict(v).get("weights", 0)))
    facts = {
        "architecture": ", ".join(archs) or None,
        "model_type": config.get("model_type"),
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "vocab_size": config.get("vocab_size"),
        "weights_in_selection": weights or None,
        "scheme": sel.get("scheme", metrics.get("scheme")),
        "method": sel.get("method"),
        "effective_bits": sel.get("effective_bits", metrics.get("effective_bits")),
        "effective_bits_all_weights": sel.get("effective_bits_all_weights"),
        "bytes_reference": metrics.get("bytes_reference"),
        "bytes_artifact": metrics.get("bytes_artifact"),
        "quantized_layers": metrics.get("quantized_layers"),
        "calibration_tokens": metrics.get("calibration_tokens"),
        "ignore": [str(i) for i in as_list(sel.get("ignore"))],
        "pinned": pinned_summary(sel.get("pinned")),
    }
    data = selection if selection is not None else (metrics or None)
    return section(
        run,
        "quantize",
        data,
        facts=facts,
        ratio=ratio(facts["bytes_reference"], facts["bytes_artifact"]),
        has_selection=selection is not None,
        heat_map=format_heat_map(layers),
        formats=format_table(layers),
        auto=auto_selection(sel),
        search=search_trace(as_list(sel.get("search"))),
        method_choice=method_choice(sel.get("method_choice")),
    )


def method_choice(record: object) -> dict[str, Any] | None:
    """`method: auto`'s trace: each candidate's calibration KL, its gain in standard errors, kept."""
    record = as_dict(record)
    if not record:
        return None
    rows = [
        {
            "method": str(row.get("method")),
            "mean_kld": row.get("mean_kld"),
            "gain_z": row.get("gain_z"),
            "kept": bool(row.get("kept")),
            "seconds": row.get("seconds"),
        }
        for row in map(as_dict, as_list(record.get("trace")))
    ]
    return {"chosen": record.get("chosen"), "tokens": record.get("tokens"), "min_z": record.get("min_z"), "rows": rows}
