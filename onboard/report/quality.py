"""The KL-divergence card (eval/kl.json) and the engine-parity card (adapt/parity.json)."""

from typing import Any

from onboard.report import svg
from onboard.report.fmt import is_num
from onboard.report.load import Run, as_dict, as_list, section

KL_STATS = ("mean_kld", "median_kld", "p90_kld", "p99_kld", "max_kld", "top1_agreement", "rms_delta_p")
MAX_PARITY_CASES = 3
TOP_LAYERS = 8  # as many as `onboard eval` prints


def kl_histogram(kl: dict[str, Any]) -> Any:
    hist = as_dict(kl.get("histogram"))
    edges, counts = as_list(hist.get("edges")), as_list(hist.get("counts"))
    if not counts or len(edges) != len(counts) + 1 or not all(is_num(e) for e in edges):
        return None
    return svg.histogram(
        edges, counts, x_label="per-token KL divergence (nats)", marker=kl.get("mean_kld"), title="KL histogram"
    )


def _layer_index(value: Any) -> int | None:
    return int(value) if is_num(value) and value == int(value) and value >= 0 else None


def format_counts(formats: Any) -> str:
    """{"nvfp4": 3, "fp8": 4} -> "4 fp8, 3 nvfp4" (most modules first); a count that is not a
    number leaves just the format's name."""
    items = sorted(as_dict(formats).items(), key=lambda kv: (-kv[1] if is_num(kv[1]) else 0, str(kv[0])))
    return ", ".join(f"{n:g} {f}" if is_num(n) else str(f) for f, n in items)


def per_layer_view(per_layer: Any) -> dict[str, Any] | None:
    """eval/kl.json's `per_layer`: a column per decoder layer of the KL with only that layer as in
    the artifact, the running KL with layers 0..i as in the artifact, and the top layers alone."""
    data = as_dict(per_layer)
    rows = []
    for entry in as_list(data.get("layers")):
        entry = as_dict(entry)
        index = _layer_index(entry.get("layer"))
        if index is None:
            continue
        alone, running = entry.get("alone_kld"), entry.get("running_kld")
        rows.append(
            {
                "layer": index,
                "formats": format_counts(entry.get("formats")),
                "alone_kld": alone if is_num(alone) else None,
                "running_kld": running if is_num(running) else None,
            }
        )
    if not rows:
        return None
    rows.sort(key=lambda r: r["layer"])
    labels = [str(r["layer"]) for r in rows]
    alone = [r["alone_kld"] for r in rows]
    ranked = sorted((r for r in rows if r["alone_kld"] is not None), key=lambda r: (-r["alone_kld"], r["layer"]))
    full = data.get("full_kld")
    return {
        "tokens": data.get("tokens") if is_num(data.get("tokens")) else None,
        "full_kld": full if is_num(full) else None,
        "alone_sum": sum(a for a in alone if a is not None) if ranked else None,
        "layers": len(rows),
        "alone_chart": svg.column_chart(
            labels, alone, x_label="decoder layer", y_label="KLD, layer alone", title="KL per layer alone"
        ),
        "running_chart": svg.line_chart(
            [("running KLD", [r["layer"] for r in rows], [r["running_kld"] for r in rows], svg.BLUE)],
            x_label="decoder layer (layers 0..i as in the artifact)",
            y_label="running KLD",
            title="running KL over layers",
        ),
        "top": ranked[:TOP_LAYERS],
    }


def build_eval(run: Run) -> dict[str, Any]:
    kl = run.json("eval/kl.json")
    data = kl or {}
    by_traffic = {str(k): as_dict(v) for k, v in sorted(as_dict(data.get("by_traffic")).items())}
    histogram = kl_histogram(data)
    traffic_chart = None
    if histogram is None and by_traffic:  # something to look at until kl.json carries a histogram
        values = [t.get("mean_kld") for t in by_traffic.values()]
        traffic_chart = svg.bar_chart(list(by_traffic), values, width=540, title="mean KLD by traffic")
    return section(
        run,
        "eval",
        kl,
        kl=data,
        stats=KL_STATS,
        by_traffic=by_traffic,
        histogram=histogram,
        traffic_chart=traffic_chart,
        per_layer=per_layer_view(data.get("per_layer")),
    )


def fast_numerics(parity: dict[str, Any]) -> dict[str, Any] | None:
    """parity.json's `fast` block (fast numerics against the same reference); None in runs older
    than the block."""
    return as_dict(parity.get("fast")) or None


def build_parity(run: Run) -> dict[str, Any]:
    parity = run.json("adapt/parity.json")
    data = parity or {}
    cases = [as_dict(c) for c in as_list(data.get("cases"))]
    # Mismatches first (they are what a reviewer must read), then the rest in file order.
    shown = sorted(range(len(cases)), key=lambda i: (cases[i].get("matched") is True, i))[:MAX_PARITY_CASES]
    return section(
        run,
        "adapt",
        parity,
        parity=data,
        cases=cases,
        matched=sum(1 for c in cases if c.get("matched") is True),
        examples=[dict(cases[i], index=i) for i in shown if cases[i].get("matched") is not True],
        fast=fast_numerics(data),
    )
