"""The report's small pieces: number formatting, SVG helpers, loop splitting, the format heat map."""

import itertools

from markupsafe import Markup

from onboard.report import fmt, svg
from onboard.report.quantize import format_heat_map
from onboard.report.smoke import split_loop
from onboard.report.verdict import decide


def test_number_formats() -> None:
    assert fmt.num(None) == "—"
    assert fmt.num(True) == "yes"
    assert fmt.num(1234567) == "1,234,567"
    assert fmt.num(0.40239) == "0.402"
    assert fmt.num(17.3445) == "17.3"
    assert fmt.num(2e-6) == "2.00e-06"
    assert fmt.num("llama") == "llama"
    assert fmt.pct(0.6781) == "67.8%"
    assert fmt.pp(0.2) == "+20.0 pp" and fmt.pp(-0.05) == "-5.0 pp"
    assert fmt.mb(269_060_552) == "269.1 MB"
    assert fmt.secs(70.68) == "70.7 s" and fmt.secs(1399.2) == "23.3 min"
    assert fmt.ratio(269.0, 116.5) == "2.31×" and fmt.ratio(1, 0) == "—"
    assert fmt.when("2026-11-30T07:13:56+00:00") == "2026-11-30 07:13:56 UTC"
    assert fmt.when("yesterday") == "yesterday"


def test_nice_ticks_cover_the_range() -> None:
    ticks = svg.nice_ticks(0.0, 1300.0, 4)
    assert ticks[0] == 0 and ticks[-1] >= 1300
    assert all(b > a for a, b in itertools.pairwise(ticks))


def test_bar_chart_escapes_labels_and_skips_missing_values() -> None:
    chart = svg.bar_chart(["<x>", "ok"], [0.5, None], title="t<")
    assert isinstance(chart, Markup)
    assert "<x>" not in chart and "&lt;x&gt;" in chart
    assert 'aria-label="t&lt;"' in chart
    assert chart.count("<rect") == 1  # the missing value draws no bar


def test_line_chart_without_points_says_so() -> None:
    assert "no data" in svg.line_chart([("a", [1, 2], [None, "x"], svg.BLUE)])


def test_split_loop() -> None:
    assert split_loop("abc def", {"char_start": 4}) == {"before": "abc ", "loop": "def", "info": {"char_start": 4}}
    for bad in (None, {"char_start": 99}, {"char_start": -1}, {"char_start": True}, {"char_start": "2"}):
        assert split_loop("abc", bad)["loop"] == ""
    assert split_loop(None, None)["before"] == ""


def test_heat_map_rows_columns_and_mixed_cells() -> None:
    layers = {
        "model.layers.10.self_attn.q_proj": {"format": "nvfp4"},
        "model.layers.2.self_attn.q_proj": {"format": "fp8"},
        "model.layers.2.mlp.experts.0.down_proj": {"format": "nvfp4"},
        "model.layers.2.mlp.experts.1.down_proj": {"format": "bf16"},
        "lm_head": {"format": "bf16"},
    }
    heat = format_heat_map(layers)
    assert heat is not None
    chart = str(heat["chart"])
    assert chart.index(">q_proj<") < chart.index(">down_proj<")  # known projections in canonical order
    assert chart.index(">2<") < chart.index(">10<")  # rows sorted numerically
    assert "2 modules: bf16, nvfp4" in chart and ">mixed<" in chart
    assert heat["others"] == [{"name": "lm_head", "format": "bf16", "color": "#94a3b8"}]
    assert format_heat_map({}) is None


def test_decide() -> None:
    ok = {"name": "a", "value": 1, "passed": True}
    bad = {"name": "b", "value": 1, "passed": False}
    assert decide(None) == "NOT EVALUATED"
    assert decide({"passed": True, "complete": True, "checks": [ok]}) == "PASS"
    assert decide({"passed": False, "complete": True, "checks": [ok, bad]}) == "FAIL"
    assert decide({"passed": False, "complete": False, "checks": [bad]}) == "INCOMPLETE"
    assert decide({"passed": True, "complete": True, "checks": [bad]}) == "FAIL"  # inconsistent file: be strict
