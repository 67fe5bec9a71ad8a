"""The KL-divergence card (eval/kl.json) and the engine-parity card (adapt/parity.json)."""

from typing import Any

from onboard.report import svg
from onboard.report.fmt import is_num
from onboard.report.load import Run, as_dict, as_list, section

KL_STATS = ("mean_kld", "median_kld", "p90_kld", "p99_kld", "max_kld", "top1_agreement", "rms_delta_p")
MAX_PARITY_CASES = 3


def kl_histogram(kl: dict[str, Any]) -> Any:
    hist = as_dict(kl.get("histogram"))
    edges, counts = as_list(hist.get("edges")), as_list(hist.get("counts"))
    if not counts or len(edges) != len(counts) + 1 or not all(is_num(e) for e in edges):
        return None
    return svg.histogram(
        edges, counts, x_label="per-token KL divergence (nats)", marker=kl.get("mean_kld"), title="KL histogram"
    )


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
    )


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
    )
