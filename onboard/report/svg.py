"""Tiny hand-made SVG charts: horizontal bars, columns, a histogram, a line chart and a heat map.

Every function returns `markupsafe.Markup` built only from numbers we format ourselves and from
text passed through `escape`, so a label taken from a JSON file (a layer name, a traffic class)
cannot inject markup. Output is deterministic: coordinates are rounded to one decimal.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

from markupsafe import Markup, escape

from onboard.report.fmt import is_num, num

BLUE = "#2563eb"
GREY = "#9ca3af"
AXIS = "#cbd5e1"
INK = "#334155"
PALETTE = ("#2563eb", "#0d9488", "#f59e0b", "#a855f7", "#ec4899", "#64748b", "#84cc16", "#0ea5e9")
FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"'
CHAR_W = 6.4  # rough width of one 11px character, for sizing label columns


def _f(x: float) -> str:
    return f"{x:.1f}"


def _text(x: float, y: float, content: Any, *, anchor: str = "start", size: int = 11, fill: str = INK) -> str:
    return (
        f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" font-size="{size}" fill="{fill}">'
        f"{escape(str(content))}</text>"
    )


def _svg(width: float, height: float, body: list[str], title: str) -> Markup:
    # No xmlns: inline SVG in HTML does not need one, and the report must hold no URL at all.
    head = (
        f'<svg class="chart" viewBox="0 0 {_f(width)} {_f(height)}" '
        f'width="{_f(width)}" height="{_f(height)}" role="img" aria-label="{escape(title)}" {FONT}>'
    )
    return Markup(head + "".join(body) + "</svg>")


def _legend(body: list[str], x: float, y: float, items: Sequence[tuple[str, str]]) -> float:
    """Colour swatches with names in one row from (x, y); returns the x where the row ends."""
    for name, color in items:
        body.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="11" height="11" rx="2" fill="{color}"/>')
        body.append(_text(x + 15, y + 10, name))
        x += 15 + len(name) * CHAR_W + 14
    return x


def _clip(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else [0.0]
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, value = [], first
    while value < hi + step * 0.5:
        ticks.append(round(value, 12))
        value += step
    return ticks


def grouped_bars(
    labels: Sequence[Any],
    series: Sequence[tuple[str, Sequence[Any], str]],
    *,
    width: int = 520,
    fmt: Callable[[Any], str] = num,
    max_value: float | None = None,
    title: str = "bar chart",
) -> Markup:
    """Horizontal bars, one group per label, one bar per series (name, values, colour).
    Missing values get no bar and an em dash. A legend is drawn when there is more than one series."""
    names = [str(label) for label in labels]
    label_w = min(max((len(n) for n in names), default=4) * CHAR_W + 12, 230)
    value_w = 64
    bar_h, gap = 14, 8
    legend_h = 20 if len(series) > 1 else 0
    group_h = bar_h * len(series) + gap
    height = legend_h + group_h * len(names) + 4
    values = [v for _, vals, _ in series for v in vals if is_num(v)]
    top = max_value if max_value is not None else max([abs(v) for v in values], default=0.0)
    top = top or 1.0
    track = width - label_w - value_w
    body: list[str] = []
    if legend_h:
        _legend(body, label_w, 3, [(name, color) for name, _, color in series])
    for i, name in enumerate(names):
        y0 = legend_h + i * group_h
        body.append(_text(label_w - 8, y0 + group_h / 2, _clip(name, int((label_w - 12) / CHAR_W)), anchor="end"))
        for j, (_, vals, color) in enumerate(series):
            value = vals[i] if i < len(vals) else None
            y = y0 + j * bar_h + 1
            if is_num(value):
                w = max(track * min(abs(value) / top, 1.0), 1.0)
                body.append(
                    f'<rect x="{_f(label_w)}" y="{_f(y)}" width="{_f(w)}" height="{bar_h - 2}" rx="2" '
                    f'fill="{color}"><title>{escape(name)}: {escape(fmt(value))}</title></rect>'
                )
                body.append(_text(label_w + w + 4, y + bar_h - 4, fmt(value), size=10))
            else:
                body.append(_text(label_w + 4, y + bar_h - 4, fmt(value), size=10))
    return _svg(width, height, body, title)


def bar_chart(labels: Sequence[Any], values: Sequence[Any], *, color: str = BLUE, **kwargs: Any) -> Markup:
    """Horizontal bar chart of one series."""
    return grouped_bars(labels, [("", values, color)], **kwargs)


def _plot_left(ticks: list[float], y_label: str) -> float:
    """The plot's left edge: 52 px, or more when long tick labels would run into the axis title."""
    widest = max((len(num(t)) for t in ticks), default=0)
    return max(52.0, (20 if y_label else 4) + widest * 6.0 + 6)


def _y_axis(body: list[str], ticks: list[float], y_of: Callable[[float], float], left: float, right: float) -> None:
    for tick in ticks:
        y = y_of(tick)
        body.append(f'<line x1="{_f(left)}" y1="{_f(y)}" x2="{_f(right)}" y2="{_f(y)}" stroke="#eef2f7"/>')
        body.append(_text(left - 6, y + 4, num(tick), anchor="end", size=10))


def histogram(
    edges: Sequence[float],
    counts: Sequence[float],
    *,
    width: int = 520,
    height: int = 210,
    x_label: str = "",
    marker: float | None = None,
    marker_label: str = "mean",
    title: str = "histogram",
) -> Markup:
    """Bins drawn at equal width (suits log-spaced edges), edge values as x tick labels, an
    optional dashed marker at the bin holding `marker`."""
    n = len(counts)
    left, right, top, bottom = 44, width - 10, 18, height - 38
    top_count = max([c for c in counts if is_num(c)], default=0) or 1
    ticks = nice_ticks(0, top_count, 4)
    y_max = max(ticks[-1], top_count)

    def y_of(v: float) -> float:
        return bottom - (bottom - top) * v / y_max

    body: list[str] = []
    _y_axis(body, ticks, y_of, left, right)
    bin_w = (right - left) / max(n, 1)
    for i, count in enumerate(counts):
        if not is_num(count) or count <= 0:
            continue
        x, y = left + i * bin_w, y_of(count)
        tip = f"{num(edges[i])} – {num(edges[i + 1])}: {num(count)}" if i + 1 < len(edges) else num(count)
        body.append(
            f'<rect x="{_f(x + 0.5)}" y="{_f(y)}" width="{_f(max(bin_w - 1, 0.5))}" height="{_f(bottom - y)}" '
            f'fill="{BLUE}"><title>{escape(tip)}</title></rect>'
        )
    body.append(f'<line x1="{left}" y1="{_f(bottom)}" x2="{right}" y2="{_f(bottom)}" stroke="{AXIS}"/>')
    step = max(1, math.ceil(len(edges) / 7))
    for i in range(0, len(edges), step):
        body.append(_text(left + i * bin_w, bottom + 14, num(edges[i], 2), anchor="middle", size=10))
    if is_num(marker) and len(edges) == n + 1:
        for i in range(n):
            if edges[i] <= marker < edges[i + 1]:
                frac = (marker - edges[i]) / (edges[i + 1] - edges[i]) if edges[i + 1] > edges[i] else 0
                x = left + (i + frac) * bin_w
                body.append(
                    f'<line x1="{_f(x)}" y1="{top - 6}" x2="{_f(x)}" y2="{_f(bottom)}" stroke="#dc2626" '
                    f'stroke-dasharray="4 3"/>'
                )
                body.append(_text(x + 4, top, f"{marker_label} {num(marker)}", size=10, fill="#dc2626"))
                break
    body.append(_text((left + right) / 2, height - 6, x_label, anchor="middle", size=10))
    return _svg(width, height, body, title)


def line_chart(
    series: Sequence[tuple[str, Sequence[Any], Sequence[Any], str]],
    *,
    width: int = 520,
    height: int = 220,
    x_label: str = "",
    y_label: str = "",
    title: str = "line chart",
) -> Markup:
    """Lines with dots for (name, xs, ys, colour) series; non-numeric points are skipped."""
    points = [[(x, y) for x, y in zip(xs, ys, strict=False) if is_num(x) and is_num(y)] for _, xs, ys, _ in series]
    flat = [p for pts in points for p in pts]
    right, top, bottom = width - 12, 24, height - 36
    body: list[str] = []
    if not flat:
        body.append(_text(width / 2, height / 2, "no data", anchor="middle"))
        return _svg(width, height, body, title)
    x_lo, x_hi = min(p[0] for p in flat), max(p[0] for p in flat)
    y_lo, y_hi = min(p[1] for p in flat), max(p[1] for p in flat)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - abs(y_lo) * 0.1 - 1e-9, y_hi + abs(y_hi) * 0.1 + 1e-9
    y_ticks = nice_ticks(y_lo, y_hi, 5)
    y_lo, y_hi = min(y_ticks[0], y_lo), max(y_ticks[-1], y_hi)
    left = _plot_left(y_ticks, y_label)

    def px(x: float) -> float:
        return left + (right - left) * (x - x_lo) / (x_hi - x_lo)

    def py(y: float) -> float:
        return bottom - (bottom - top) * (y - y_lo) / (y_hi - y_lo)

    _y_axis(body, y_ticks, py, left, right)
    body.append(f'<line x1="{_f(left)}" y1="{_f(bottom)}" x2="{right}" y2="{_f(bottom)}" stroke="{AXIS}"/>')
    integer_x = all(isinstance(p[0], int) for p in flat)  # steps, layers, epochs: no "0.5" tick
    for tick in nice_ticks(x_lo, x_hi, 6):
        if x_lo <= tick <= x_hi and not (integer_x and tick != int(tick)):
            body.append(_text(px(tick), bottom + 14, num(int(tick) if integer_x else tick), anchor="middle", size=10))
    for (name, _, _, color), pts in zip(series, points, strict=True):
        coords = " ".join(f"{_f(px(x))},{_f(py(y))}" for x, y in pts)
        body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            tip = f"{name} {num(x)}: {num(y)}" if name else f"{num(x)}: {num(y)}"
            body.append(
                f'<circle cx="{_f(px(x))}" cy="{_f(py(y))}" r="3" fill="{color}"><title>{escape(tip)}</title></circle>'
            )
    if len(series) > 1:
        _legend(body, left, 3, [(name, color) for name, _, _, color in series])
    _axis_labels(body, (left + right) / 2, height - 6, (top + bottom) / 2, x_label, y_label)
    return _svg(width, height, body, title)


def _axis_labels(body: list[str], x_mid: float, x_base: float, y_mid: float, x_label: str, y_label: str) -> None:
    body.append(_text(x_mid, x_base, x_label, anchor="middle", size=10))
    if y_label:
        body.append(
            f'<text transform="translate(12 {_f(y_mid)}) rotate(-90)" text-anchor="middle" '
            f'font-size="10" fill="{INK}">{escape(y_label)}</text>'
        )


def heat_map(
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    cells: dict[tuple[str, str], tuple[str, str]],
    *,
    legend: Sequence[tuple[str, str]] = (),
    title: str = "heat map",
) -> Markup:
    """A grid of coloured cells: `cells[(row, col)] = (colour, tooltip)`; absent cells stay blank.
    Row height shrinks with the number of rows so a deep model still fits on a screen."""
    label_w = max((len(r) for r in row_labels), default=2) * CHAR_W + 10
    cell_w = max(max((len(c) for c in col_labels), default=4) * CHAR_W + 8, 40)
    cell_h = max(6.0, min(16.0, 420 / max(len(row_labels), 1)))
    header_h = 20
    legend_h = 24 if legend else 0
    width = label_w + cell_w * len(col_labels) + 4
    height = header_h + cell_h * len(row_labels) + legend_h + 6
    label_every = max(1, math.ceil(10 / cell_h))
    body: list[str] = []
    for j, col in enumerate(col_labels):
        body.append(_text(label_w + (j + 0.5) * cell_w, 13, col, anchor="middle", size=10))
    for i, row in enumerate(row_labels):
        y = header_h + i * cell_h
        if i % label_every == 0:
            body.append(_text(label_w - 6, y + cell_h / 2 + 3.5, row, anchor="end", size=10))
        for j, col in enumerate(col_labels):
            cell = cells.get((row, col))
            if cell is None:
                continue
            color, tip = cell
            body.append(
                f'<rect x="{_f(label_w + j * cell_w + 1)}" y="{_f(y + 0.5)}" width="{_f(cell_w - 2)}" '
                f'height="{_f(max(cell_h - 1, 1))}" fill="{color}"><title>{escape(tip)}</title></rect>'
            )
    width = max(width, _legend(body, label_w, header_h + cell_h * len(row_labels) + 10, legend))
    return _svg(width, height, body, title)


def column_chart(
    labels: Sequence[Any],
    values: Sequence[Any],
    *,
    width: int = 520,
    height: int = 200,
    color: str = BLUE,
    x_label: str = "",
    y_label: str = "",
    title: str = "column chart",
) -> Markup:
    """Vertical bars in the given order at a fixed width, so a deep model (80 layers) still fits:
    the columns narrow and only every n-th label is written; every column keeps its own tooltip.
    Missing values get no column."""
    names = [str(label) for label in labels]
    right, top, bottom = width - 12, 16, height - 36
    body: list[str] = []
    nums = [v for v in values if is_num(v)]
    if not names or not nums:
        body.append(_text(width / 2, height / 2, "no data", anchor="middle"))
        return _svg(width, height, body, title)
    y_lo, y_hi = min(0.0, *nums), max(0.0, *nums)
    if y_hi == y_lo:
        y_hi = y_lo + 1.0
    ticks = nice_ticks(y_lo, y_hi, 5)
    y_lo, y_hi = min(ticks[0], y_lo), max(ticks[-1], y_hi)
    left = _plot_left(ticks, y_label)

    def py(v: float) -> float:
        return bottom - (bottom - top) * (v - y_lo) / (y_hi - y_lo)

    _y_axis(body, ticks, py, left, right)
    slot = (right - left) / len(names)
    pad = min(slot * 0.15, 3.0)
    zero = py(0.0)
    widest = max(len(n) for n in names) * CHAR_W + 6
    label_every = max(1, math.ceil(widest / slot))
    for i, name in enumerate(names):
        value = values[i] if i < len(values) else None
        x = left + i * slot
        if is_num(value):
            y = py(value)
            body.append(
                f'<rect x="{_f(x + pad)}" y="{_f(min(y, zero))}" width="{_f(max(slot - 2 * pad, 0.5))}" '
                f'height="{_f(max(abs(zero - y), 0.5))}" fill="{color}"><title>{escape(name)}: {escape(num(value))}'
                f"</title></rect>"
            )
        if i % label_every == 0:
            body.append(_text(x + slot / 2, bottom + 14, name, anchor="middle", size=10))
    body.append(f'<line x1="{_f(left)}" y1="{_f(zero)}" x2="{right}" y2="{_f(zero)}" stroke="{AXIS}"/>')
    _axis_labels(body, (left + right) / 2, height - 6, (top + bottom) / 2, x_label, y_label)
    return _svg(width, height, body, title)
