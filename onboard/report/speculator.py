"""The speculator card: acceptance per draft position and per traffic class, and the training curve."""

from typing import Any

from onboard.report import svg
from onboard.report.fmt import pct
from onboard.report.load import Run, as_dict, as_list, section
from onboard.workspace import SPECULATOR_METRICS, SPECULATOR_TRAIN


def acceptance_chart(metrics: dict[str, Any], by_traffic: dict[str, dict[str, Any]]) -> Any:
    overall = as_list(metrics.get("per_position_acceptance"))
    series = [("all traffic", overall)]
    series += [(name, as_list(t.get("per_position_acceptance"))) for name, t in by_traffic.items()]
    series = [(name, values) for name, values in series if values]
    if not series:
        return None
    positions = max(len(values) for _, values in series)
    colored = [(name, values, svg.PALETTE[i % len(svg.PALETTE)]) for i, (name, values) in enumerate(series)]
    return svg.grouped_bars(
        [f"draft token {p + 1}" for p in range(positions)],
        colored,
        width=540,
        fmt=pct,
        max_value=1.0,
        title="acceptance rate per draft position",
    )


def training_charts(train: dict[str, Any]) -> list[Any]:
    history = [as_dict(h) for h in as_list(train.get("history"))]
    if not history:
        return []
    epochs = [h.get("epoch", i + 1) for i, h in enumerate(history)]
    charts = []
    for key, label, color in (
        ("loss", "training loss", svg.PALETTE[0]),
        ("acceptance_estimate", "acceptance estimate", svg.PALETTE[1]),
    ):
        values = [h.get(key) for h in history]
        if any(v is not None for v in values):
            charts.append(
                svg.line_chart(
                    [(label, epochs, values, color)], width=540, height=170, x_label="epoch", y_label=label, title=label
                )
            )
    return charts


MTP_ROWS = (("BF16 source", "bf16"), ("quantized artifact", "artifact"), ("artifact, fine-tuned", "retrained"))


def mtp_rows(metrics: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """metrics.json's `mtp` entry (artifacts that keep MTP layers), one row per target measured."""
    mtp = as_dict(metrics.get("mtp"))
    return [(label, as_dict(mtp[key])) for label, key in MTP_ROWS if isinstance(mtp.get(key), dict)]


def build(run: Run) -> dict[str, Any]:
    metrics = run.json(SPECULATOR_METRICS)
    train = run.json(SPECULATOR_TRAIN) or {}
    data = metrics or {}
    by_traffic = {str(k): as_dict(v) for k, v in sorted(as_dict(data.get("by_traffic")).items())}
    return section(
        run,
        "speculator",
        metrics,
        metrics=data,
        by_traffic=by_traffic,
        acceptance_chart=acceptance_chart(data, by_traffic),
        mtp_rows=mtp_rows(data),
        training_charts=training_charts(train),
        settings=as_dict(train.get("settings")),
    )
