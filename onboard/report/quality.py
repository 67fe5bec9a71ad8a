"""The KL-divergence card (eval/kl.json) and the engine-parity card (adapt/parity.json)."""

from typing import Any

from onboard.report import svg
from onboard.report.fmt import MISSING, is_num, num, pct
from onboard.report.load import Run, as_dict, as_list, section
from onboard.workspace import KL, PARITY

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
    kl = run.json(KL)
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


# parity.json's `rule` (onboard/adapt/measure.py): what judged the run, in words.
PARITY_RULES = {
    "bitwise": "every logit and greedy token transformers' own",
    "near_tie": "greedy text parts from transformers' only at near-ties",
    "layerwise_distribution": "4-bit activations: each layer against its floor, the distribution against the source",
}


def parity_rule(parity: dict[str, Any]) -> str:
    """The rule and what it means; a file older than the key was judged by the near-tie rule."""
    rule = parity.get("rule")
    if rule is None:
        return f"near_tie ({PARITY_RULES['near_tie']}; parity.json predates the rule key)"
    if rule in PARITY_RULES:
        return f"{rule} ({PARITY_RULES[rule]})"
    return f"{num(rule)} (unknown rule)"


def distribution_view(parity: dict[str, Any]) -> list[tuple[str, str, str]] | None:
    """The layerwise-distribution rule's statistics (`distribution`, `fast.distribution`) as rows of
    (measure, exact, fast); None when neither block is there (runs without 4-bit activations)."""
    exact = as_dict(parity.get("distribution"))
    fast = as_dict(as_dict(parity.get("fast")).get("distribution"))
    if not exact and not fast:
        return None

    def damage(block: dict[str, Any]) -> str:
        shown = pct(block.get("damage_diff"), 2)
        se = block.get("damage_diff_se")
        return f"{shown} ± {pct(se, 2)}" if is_num(se) else shown

    rows = [
        ("KL(transformers‖engine) ÷ the one-ulp floor", lambda b: num(b.get("kl_ratio"))),
        ("KL(transformers‖engine)", lambda b: num(b.get("kl_transformers_engine"))),
        (
            "KL(transformers‖transformers, inputs moved one ulp): the floor",
            lambda b: num(b.get("kl_transformers_floor")),
        ),
        ("KL(source‖transformers): the damage transformers measures", lambda b: num(b.get("kl_source_transformers"))),
        ("KL(source‖engine): the damage the engine serves", lambda b: num(b.get("kl_source_engine"))),
        ("damage difference (± standard error)", damage),
        ("positions", lambda b: num(b.get("num_positions"))),
    ]
    return [(label, cell(exact) if exact else MISSING, cell(fast) if fast else MISSING) for label, cell in rows]


def _ratio(value: Any, allowed: Any) -> str:
    return f"{num(value)} (allowed ≤ {num(allowed)})" if is_num(allowed) else num(value)


def layerwise_view(parity: dict[str, Any]) -> list[tuple[str, str]] | None:
    """parity.json's `layerwise` block as (label, value) rows: the worst layer (largest RMS error over
    its floor) with its floor ratio and its worst linear, the largest linear ratio of any layer, the
    verdict, and where it first failed; None when the block is not there."""
    block = as_dict(parity.get("layerwise"))
    if not block:
        return None
    layers = [as_dict(e) for e in as_list(block.get("layers"))]
    head = as_dict(block.get("head"))
    ranked = [e for e in [*layers, head] if is_num(e.get("floor_ratio"))]
    worst = max(ranked, key=lambda e: e["floor_ratio"], default={})
    linear = worst.get("worst_linear")
    linear_ratio = num(worst.get("linear_ratio"))
    tokens = block.get("num_tokens")
    rows = [
        ("checked", f"{len(layers)} decoder layers and the head on {num(tokens)} tokens"),
        ("worst layer", num(worst.get("layer"))),
        ("its RMS error ÷ floor", _ratio(worst.get("floor_ratio"), block.get("max_layer_ratio"))),
        ("its worst linear ÷ rounding step", f"{linear_ratio} ({linear})" if linear else linear_ratio),
        (
            "largest linear ÷ rounding step, any layer",
            _ratio(block.get("max_linear_ratio"), block.get("max_linear_ratio_allowed")),
        ),
        ("passed", num(block.get("passed"))),
    ]
    if block.get("passed") is not True:
        rows.append(("first failing layer", num(block.get("first_failing_layer"))))
        rows.append(("first failing module", num(block.get("first_failing_module"))))
    return rows


def build_parity(run: Run) -> dict[str, Any]:
    parity = run.json(PARITY)
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
        rule=parity_rule(data),
        distribution=distribution_view(data),
        layerwise=layerwise_view(data),
    )
