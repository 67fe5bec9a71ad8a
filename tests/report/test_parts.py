"""The report's small pieces: number formatting, SVG helpers, loop splitting, the format heat map,
the per-layer KL view and the auto-selection tables."""

import itertools
import re

from markupsafe import Markup

from onboard.report import fmt, svg
from onboard.report.quality import format_counts, per_layer_view
from onboard.report.quantize import format_heat_map
from onboard.report.selection import auto_selection, search_trace
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


def test_column_chart_thins_labels_not_columns() -> None:
    labels = [str(i) for i in range(80)]
    values = [0.01 * (i % 7) for i in range(80)]
    values[5] = None
    values[6] = "0.5"  # a string is not a measurement
    chart = str(svg.column_chart(labels, values, title="t"))
    assert chart.count("<rect") == 78  # one column per numeric value, none for the two bad ones
    assert "<title>4: 0.0400</title>" in chart and "<title>6:" not in chart
    x_labels = re.findall(r'text-anchor="middle" font-size="10" fill="#334155">(\d+)</text>', chart)
    assert x_labels[0] == "0" and 5 < len(x_labels) < 40  # every n-th layer labelled
    assert "&lt;b&gt;" in str(svg.column_chart(["<b>"], [1.0]))
    assert "no data" in str(svg.column_chart(["a"], [None]))


def test_line_chart_integer_x_has_integer_ticks() -> None:
    chart = str(svg.line_chart([("a", [0, 1, 2, 3], [0.1, 0.2, 0.15, 0.3], svg.BLUE)]))
    ticks = re.findall(r'y="\d+\.\d" text-anchor="middle" font-size="10" fill="#334155">([^<]+)</text>', chart)
    assert ticks == ["0", "1", "2", "3"]


def test_format_counts() -> None:
    assert format_counts({"nvfp4": 3, "fp8": 4}) == "4 fp8, 3 nvfp4"
    assert format_counts({"nvfp4": 7}) == "7 nvfp4"
    assert format_counts({"fp8": "four", "nvfp4": None}) == "fp8, nvfp4"  # no count shown that is not one
    assert format_counts(None) == "" and format_counts(["fp8"]) == ""


def test_per_layer_view_orders_layers_and_ranks_the_top() -> None:
    layers = [
        {"layer": 2, "formats": {"nvfp4": 7}, "alone_kld": 0.09, "running_kld": 0.26},
        {"layer": 0, "formats": {"fp8": 4, "nvfp4": 3}, "alone_kld": 0.031, "running_kld": 0.031},
        {"layer": 1, "formats": {"nvfp4": 7}, "alone_kld": 0.12, "running_kld": 0.16},
    ]
    view = per_layer_view({"tokens": 2048, "full_kld": 0.26, "layers": layers})
    assert view is not None
    assert [r["layer"] for r in view["top"]] == [1, 2, 0]
    assert view["top"][2]["formats"] == "4 fp8, 3 nvfp4"
    assert view["alone_sum"] == 0.031 + 0.12 + 0.09 and view["layers"] == 3
    alone = str(view["alone_chart"])
    assert alone.index("<title>0: 0.0310</title>") < alone.index("<title>1: 0.120</title>")  # layer order
    assert alone.index("<title>1: 0.120</title>") < alone.index("<title>2: 0.0900</title>")
    running = str(view["running_chart"])
    assert "running KLD 2: 0.260" in running and "running KLD 0: 0.0310" in running


def test_per_layer_view_tolerates_malformed_rows() -> None:
    assert per_layer_view(None) is None and per_layer_view({"layers": "many"}) is None
    assert per_layer_view({"layers": [{"layer": "x", "alone_kld": 1.0}, None, 3]}) is None
    view = per_layer_view(
        {
            "tokens": "lots",
            "full_kld": "0.4",
            "layers": [
                {"layer": 0, "formats": "fp8", "alone_kld": "0.5", "running_kld": None},
                {"layer": 1.5, "alone_kld": 0.2},  # not a layer index: dropped
                {"layer": True, "alone_kld": 0.2},
                {"layer": 1, "formats": {"nvfp4": 7}, "alone_kld": 0.2, "running_kld": float("nan")},
            ],
        }
    )
    assert view is not None and view["layers"] == 2
    assert view["tokens"] is None and view["full_kld"] is None
    assert [r["layer"] for r in view["top"]] == [1]  # the string "0.5" is not ranked as a number
    assert view["top"][0]["running_kld"] is None
    assert "0: 0.5" not in str(view["alone_chart"]) and "<title>1: 0.200</title>" in str(view["alone_chart"])


def test_auto_selection_lists_the_groups_above_the_base() -> None:
    sel = {
        "base": "nvfp4",
        "formats": ["nvfp4", "fp8", "bf16"],
        "groups": [
            {"name": "a.qkv", "layer": 0, "format": "fp8", "weights": 100, "bits": {"fp8": 8.03}},
            {"name": "a.o_proj", "layer": 0, "format": "nvfp4", "weights": 300},
            {"name": "b.down_proj", "layer": 1, "format": "bf16", "weights": 100, "bits": {"bf16": 16.0}},
        ],
        "sensitivity": {
            "measured": {"a.qkv": {"nvfp4": 0.02, "fp8": 0.002}, "b.down_proj": {"nvfp4": 0.09}},
            "fisher": {"a.qkv": {"nvfp4": None}, "b.down_proj": {"nvfp4": 0.07}},
            "rank_correlation": {"fp8": 0.79, "nvfp4": 0.83},
        },
    }
    auto = auto_selection(sel)
    assert auto is not None and auto["base"] == "nvfp4"
    rows = [(g["name"], g["layer"], g["format"], g["measured_base"], g["fisher_base"]) for g in auto["groups"]]
    assert rows == [("b.down_proj", 1, "bf16", 0.09, 0.07), ("a.qkv", 0, "fp8", 0.02, None)]  # most sensitive first
    assert auto["groups"][1]["bits"] == 8.03 and auto["groups"][1]["measured_format"] == 0.002
    facts = dict(auto["facts"])
    assert facts["rank correlation, measured vs Fisher"] == "nvfp4 0.830 · fp8 0.790"  # ladder order
    assert facts["kept above nvfp4"] == "2 of 3 groups (40.0% of their weights)"
    assert auto_selection({"scheme": "nvfp4", "layers": {}, "pinned": {}, "search": []}) is None


def test_auto_selection_tolerates_malformed_values() -> None:
    sel = {
        "base": "nvfp4",
        "bits_budget": "5.5",
        "search_tokens": None,
        "artifact_kld": "0.19",
        "additive": "fast",
        "final": {"upgraded": "all", "measured_kld": "0.2", "predicted_kld": None, "effective_bits": 5.5},
        "groups": [
            {"name": "g1", "layer": "zero", "format": "fp8", "weights": "many", "bits": {"fp8": "8"}},
            {"name": "g2", "format": None},
            "g3",
        ],
        "sensitivity": {"measured": {"g1": {"nvfp4": "0.5"}}, "fisher": [], "rank_correlation": {"nvfp4": "high"}},
    }
    auto = auto_selection(sel)
    assert auto is not None
    [row] = auto["groups"]  # g2 has no format, g3 is no group
    assert row["name"] == "g1" and row["format"] == "fp8"
    assert row["layer"] is None and row["weights"] is None and row["bits"] is None and row["measured_base"] is None
    facts = dict(auto["facts"])
    assert facts["bits budget (per quantizable weight)"] == "—" and facts["artifact KLD (same tokens)"] == "—"
    assert facts["additive start (calibration text)"] == "—"
    assert (
        facts["after the search (calibration text)"] == "measured KLD — (predicted —) · 5.50 bits · 0 groups upgraded"
    )
    assert facts["rank correlation, measured vs Fisher"] == "nvfp4 —"
    assert auto["sensitivity_chart"] is None  # no measured number to draw
    assert auto_selection({"groups": [{"name": "g", "format": "fp8"}]})["groups"] == []  # no base: nothing to compare
    only_final = auto_selection({"base": "nvfp4", "final": {"upgraded": {"g": "fp8", "h": "nvfp4"}}})
    assert [g["name"] for g in only_final["groups"]] == ["g"]
    assert dict(only_final["facts"])["kept above nvfp4"] == "1 group"  # the number of groups is unknown


def test_sensitivity_chart_escapes_group_names() -> None:
    sel = {"base": "nvfp4", "sensitivity": {"measured": {"<img src=x>": {"nvfp4": 0.1}}, "fisher": {}}}
    chart = str(auto_selection(sel)["sensitivity_chart"])
    assert "<img" not in chart and "&lt;img src=x&gt;" in chart
    assert "Fisher estimate" not in chart  # no estimate: one series, no legend


def test_search_trace_by_step_with_accepted_steps() -> None:
    steps = [
        {
            "step": 0,
            "move": "additive start",
            "effective_bits": 5.49,
            "mean_kld": 0.2,
            "best_kld": 0.2,
            "accepted": True,
        },
        {"step": 1, "move": "g1→fp8", "effective_bits": 5.5, "mean_kld": 0.21, "best_kld": 0.2, "accepted": False},
        {"step": 2, "move": "g2→fp8", "effective_bits": "5.5", "mean_kld": 0.19, "best_kld": 0.19, "accepted": True},
        "junk",
    ]
    trace = search_trace(steps)
    assert trace is not None and trace["accepted"] == 2
    assert [r["accepted"] for r in trace["rows"]] == [True, False, True]
    assert dict(trace["rows"][2]["cells"])["effective_bits"] is None  # a string is not shown as bits
    chart = str(trace["chart"])
    assert "search step" in chart and "effective bits" not in chart
    assert "measured KLD 1: 0.210" in chart and "best KLD so far 2: 0.190" in chart
    old = search_trace([{"effective_bits": 4.5, "mean_kld": 0.5}, {"effective_bits": 4.6, "mean_kld": 0.4}])
    assert old is not None and "effective bits" in str(old["chart"]) and old["accepted"] == 0
    assert search_trace([]) is None and search_trace(["x"]) is None
