"""`write_report`: one self-contained, escaped, deterministic HTML file that degrades per section."""

import json
import os
import re
import sys
import types
from pathlib import Path

import pytest

from onboard.errors import OnboardError
from onboard.report import write_report

from .runs import FAILED_CHECKS, LOOP, build_run, write


def section(html: str, section_id: str) -> str:
    match = re.search(rf'<section[^>]*id="{section_id}"[^>]*>(.*?)</section>', html, re.DOTALL)
    assert match, f"no section {section_id!r}"
    return match.group(1)


def test_writes_one_self_contained_file(full_run_dir: Path) -> None:
    before = {p for p in full_run_dir.rglob("*")}
    report = write_report(full_run_dir)
    assert report == full_run_dir / "report.html"
    assert {p for p in full_run_dir.rglob("*")} - before == {report}  # no temp file, no side files
    html = report.read_text()
    lowered = html.lower()
    for forbidden in ("http://", "https://", 'src="//', "<link", "<script", "@import", "url("):
        assert forbidden not in lowered, forbidden
    assert html.startswith("<!doctype html>")
    assert "<style>" in html


def test_model_outputs_are_escaped(full_run_dir: Path) -> None:
    html = write_report(full_run_dir).read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; more" in html
    assert "<b>bold</b>" not in html
    assert "<script" not in html.lower()
    assert "&lt;i&gt;engine&lt;/i&gt;" in section(html, "parity")  # the diverging parity case
    assert "Tell me about &lt;cats&gt; &amp; dogs" in html  # the prompt


def test_loop_span_is_marked(full_run_dir: Path) -> None:
    smoke = section(write_report(full_run_dir).read_text(), "smoke")
    marks = re.findall(r"<mark[^>]*>(.*?)</mark>", smoke, re.DOTALL)
    assert marks == [LOOP]  # only the artifact text of the loop case has a loop
    before = smoke[: smoke.index("<mark")]
    assert before.endswith("&lt;b&gt;bold&lt;/b&gt; &amp; more. ")  # the escaped text before the loop


def test_detector_rates_shown_as_percentages(full_run_dir: Path) -> None:
    smoke = section(write_report(full_run_dir).read_text(), "smoke")
    row = re.search(r"<tr><td>token loops</td>(.*?)</tr>", smoke).group(1)
    assert re.findall(r'<td class="n">([^<]*)</td>', row) == ["25.0%", "5.0%", "+20.0 pp"]
    assert re.search(r"<tr><td>distinct-2</td><td class=\"n\">0.610</td>", smoke)  # not a rate


def test_strings_in_charts_are_escaped(full_run_dir: Path) -> None:
    metrics = json.loads((full_run_dir / "speculator/metrics.json").read_text())
    metrics["by_traffic"]['<img src=x onerror="alert(1)">'] = metrics["by_traffic"].pop("chat")
    write(full_run_dir, "speculator/metrics.json", metrics)
    html = write_report(full_run_dir).read_text()
    assert "<img" not in html
    chart = re.search(r'<svg[^>]*aria-label="acceptance rate per draft position".*?</svg>', html, re.DOTALL)
    assert chart and "&lt;img src=x onerror=" in chart.group(0)


def test_partial_run_shows_not_run(partial_run_dir: Path) -> None:
    html = write_report(partial_run_dir).read_text()
    for section_id in ("eval", "speculator", "parity", "smoke", "bench"):
        assert "not run" in section(html, section_id), section_id
    assert "not run" not in section(html, "model")
    assert "format per layer" in section(html, "formats")
    verdict = section(html, "verdict")
    assert re.search(r'class="big">\s*INCOMPLETE\s*<', verdict)  # the real gate, evaluated now
    assert "smoke: not run" in verdict  # the loop-rate tile says why it is empty


def test_a_gate_json_older_than_the_run_is_evaluated_again(tmp_path: Path) -> None:
    run = build_run(tmp_path / "run", with_gate=True)
    assert re.search(r'class="big">\s*PASS\s*<', write_report(run).read_text())
    manifest = run / "manifest.json"
    manifest.write_text(manifest.read_text())  # a stage finished after the gate ran
    os.utime(run / "gate.json", (1, 1))
    assert "evaluated at report time" in section(write_report(run).read_text(), "verdict")


def test_failed_gate_lists_failed_checks(full_run_dir: Path) -> None:
    verdict = section(write_report(full_run_dir).read_text(), "verdict")
    head = verdict[: verdict.index('class="tiles"')]
    assert re.search(r'class="big">\s*FAIL\s*<', head)
    for name in FAILED_CHECKS:
        assert f"<b>{name}</b>" in head
    assert "<b>top1_agreement</b>" not in head  # passed checks are not listed as failures
    assert f"{len(FAILED_CHECKS)} of 5 gate checks failed" in head


def test_passed_and_incomplete_verdicts(tmp_path: Path) -> None:
    passed = build_run(tmp_path / "pass", with_gate=True)
    assert re.search(r'class="big">\s*PASS\s*<', write_report(passed).read_text())
    gate = json.loads((passed / "gate.json").read_text())
    write(passed, "gate.json", {**gate, "passed": False, "complete": False, "missing": ["smoke"]})
    verdict = section(write_report(passed).read_text(), "verdict")
    assert re.search(r'class="big">\s*INCOMPLETE\s*<', verdict)
    assert "Stages not run: <b>smoke</b>" in verdict


def test_gate_evaluated_when_no_gate_json(partial_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def evaluate_gate(run_dir: Path) -> dict:
        calls.append(run_dir)
        check = {"name": "mean_kld", "stage": "eval", "value": None, "threshold": 0.3, "passed": False}
        return {"passed": False, "complete": False, "missing": ["eval"], "checks": [check]}

    monkeypatch.setitem(sys.modules, "onboard.gate", types.SimpleNamespace(evaluate_gate=evaluate_gate))
    verdict = section(write_report(partial_run_dir).read_text(), "verdict")
    assert calls == [partial_run_dir]
    assert "INCOMPLETE" in verdict
    assert "1 checks not measured yet: mean_kld" in verdict


def test_gate_error_does_not_stop_the_report(partial_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def evaluate_gate(run_dir: Path) -> dict:
        raise OnboardError("recipe gate: max_mean_kld must be positive")

    monkeypatch.setitem(sys.modules, "onboard.gate", types.SimpleNamespace(evaluate_gate=evaluate_gate))
    verdict = section(write_report(partial_run_dir).read_text(), "verdict")
    assert "NOT EVALUATED" in verdict
    assert "gate not evaluated: recipe gate: max_mean_kld must be positive" in verdict


def test_charts_are_inline_svg(full_run_dir: Path) -> None:
    html = write_report(full_run_dir).read_text()
    labels = set(re.findall(r'<svg class="chart"[^>]*aria-label="([^"]*)"', html))
    expected = {"format per layer", "KL histogram", "acceptance rate per draft position", "training loss",
                "acceptance estimate", "detector rates, artifact vs reference", "stage wall time",
                "KL per layer alone", "running KL over layers", "sensitivity in nvfp4, measured vs Fisher",
                "selection trace"}  # fmt: skip
    assert expected <= labels
    heat = re.search(r'aria-label="format per layer".*?</svg>', html, re.DOTALL).group(0)
    assert heat.count("<rect") >= 4 * 7  # one cell per projection per decoder layer (+ legend)
    assert "#f59e0b" in heat and "model.layers.0.mlp.down_proj: fp8" in heat  # fp8 cell, tooltip
    hist = re.search(r'aria-label="KL histogram".*?</svg>', html, re.DOTALL).group(0)
    assert hist.count("<rect") == 21  # every non-empty bin
    assert "lm_head" in section(html, "formats")  # outside the decoder stack, listed apart


def test_deterministic(full_run_dir: Path) -> None:
    first = write_report(full_run_dir).read_bytes()
    second = write_report(full_run_dir).read_bytes()
    assert first == second


def test_malformed_json_is_reported_not_fatal(full_run_dir: Path) -> None:
    (full_run_dir / "eval/kl.json").write_text("{not json")
    html = write_report(full_run_dir).read_text()
    assert "eval/kl.json: unreadable" in html
    assert "KL histogram" not in html


def test_missing_run_dir_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(OnboardError, match="run directory not found"):
        write_report(tmp_path / "nope")


def test_smoke_throughput_comes_from_the_manifest(full_run_dir: Path) -> None:
    html = write_report(full_run_dir).read_text()
    assert "artifact_greedy_tokens_per_s" in html or "45.3" in html


def test_per_layer_kl_chart_and_top_layers(full_run_dir: Path) -> None:
    html = section(write_report(full_run_dir).read_text(), "eval")
    alone = re.search(r'<svg[^>]*aria-label="KL per layer alone".*?</svg>', html, re.DOTALL).group(0)
    tips = re.findall(r"<title>([^<]*)</title>", alone)
    assert tips == ["0: 0.0310", "1: 0.120", "2: 0.0900", "3: 0.150"]  # every layer, in layer order
    running = re.search(r'<svg[^>]*aria-label="running KL over layers".*?</svg>', html, re.DOTALL).group(0)
    assert "running KLD 3: 0.410" in running and running.count("<circle") == 4
    rows = re.findall(r'<tr><td class="n">(\d+)</td><td>([^<]*)</td><td class="n">([^<]*)</td>', html)
    assert rows == [
        ("3", "6 nvfp4, 1 bf16", "0.150"),
        ("1", "7 nvfp4", "0.120"),
        ("2", "7 nvfp4", "0.0900"),
        ("0", "4 fp8, 3 nvfp4", "0.0310"),
    ]
    assert "per-layer KL not measured" not in html


def test_per_layer_kl_absent_or_malformed(full_run_dir: Path) -> None:
    kl = json.loads((full_run_dir / "eval/kl.json").read_text())
    per_layer = kl.pop("per_layer")
    write(full_run_dir, "eval/kl.json", kl)
    html = section(write_report(full_run_dir).read_text(), "eval")
    assert "per-layer KL not measured" in html and "KL per layer alone" not in html
    per_layer["tokens"] = "2048"
    per_layer["layers"][0] = {"layer": 0, "formats": {"fp8": "4"}, "alone_kld": "0.77", "running_kld": None}
    per_layer["layers"][1]["alone_kld"] = None
    per_layer["layers"].append({"layer": "<b>x</b>", "alone_kld": 9.5})
    write(full_run_dir, "eval/kl.json", {**kl, "per_layer": per_layer})
    html = section(write_report(full_run_dir).read_text(), "eval")
    alone = re.search(r'<svg[^>]*aria-label="KL per layer alone".*?</svg>', html, re.DOTALL).group(0)
    assert re.findall(r"<title>([^<]*)</title>", alone) == ["2: 0.0900", "3: 0.150"]
    per_layer_part = html[html.index("KL per decoder layer") :]
    for shown in (": 0.77", ">0.77", ": 9.50", ">9.50", "<b>x</b>", "&lt;b&gt;"):
        assert shown not in per_layer_part, shown  # neither the string KLD nor the row without a layer index
    assert re.search(r"<th>tokens · layers</th><td class=\"n\">— · 4</td>", html)


def test_auto_selection_card(full_run_dir: Path) -> None:
    html = section(write_report(full_run_dir).read_text(), "auto")
    for fact in (
        '<th>base format · ladder</th><td class="n">nvfp4 · nvfp4 → fp8 → bf16</td>',
        '<th>bits budget (per quantizable weight)</th><td class="n">5.50</td>',
        '<th>search tokens · steps</th><td class="n">2,048 · 32</td>',
        "measured KLD 0.200 (predicted 0.180) · 5.49 bits · 2 groups upgraded",
        "measured KLD 0.190 (predicted 0.170) · 5.50 bits · 3 groups upgraded",
        '<th>artifact KLD (same tokens)</th><td class="n">0.191</td>',
        "nvfp4 0.830 · fp8 —",
        "3 of 16 groups",
    ):
        assert fact in html, fact
    table = html[html.index("Groups kept above nvfp4") :]
    rows = re.findall(r"<tr><td>([^<]*)</td><td class=\"n\">([^<]*)</td><td><span[^>]*></span>([^<]*)</td>", table)
    assert rows == [
        ("model.layers.3.self_attn.o_proj", "3", "bf16"),  # most sensitive in nvfp4 first
        ("model.layers.0.mlp.down_proj", "0", "fp8"),
        ("model.layers.0.self_attn.qkv", "0", "fp8"),
    ]
    first = table[table.index("model.layers.3.self_attn.o_proj") : table.index("</tr>", table.index("o_proj"))]
    assert re.findall(r'<td class="n">([^<]*)</td>', first) == ["3", "16.0", "331,776", "0.0900", "0.0720", "—"]
    chart = re.search(r'<svg[^>]*aria-label="sensitivity in nvfp4, measured vs Fisher".*?</svg>', html, re.DOTALL)
    assert chart and chart.group(0).count(">model.layers.3.self_attn.o_proj<") == 1
    model = section(write_report(full_run_dir).read_text(), "model")
    assert '<th>pinned by pattern</th><td class="n">1 bf16 · 2 fp8</td>' in model


def test_auto_selection_absent_or_malformed(full_run_dir: Path) -> None:
    sel = json.loads((full_run_dir / "quantize/selection.json").read_text())
    auto_keys = ("base", "formats", "bits_budget", "search_tokens", "search_steps", "groups", "sensitivity")
    fixed = {k: v for k, v in sel.items() if k not in (*auto_keys, "additive", "final", "artifact_kld")}
    write(full_run_dir, "quantize/selection.json", {**fixed, "scheme": "nvfp4", "pinned": {}, "search": []})
    html = write_report(full_run_dir).read_text()
    assert 'id="auto"' not in html and 'id="search"' not in html  # a fixed scheme: no selection cards
    assert '<th>pinned by pattern</th><td class="n">—</td>' in section(html, "model")

    write(full_run_dir, "quantize/selection.json", {**sel, "groups": [], "final": {}, "sensitivity": None})
    html = section(write_report(full_run_dir).read_text(), "auto")
    assert "no group kept above the base format" in html
    assert "no measured sensitivities in quantize/selection.json" in html

    groups = sel["groups"]
    groups[0] = {**groups[0], "format": "fp8", "layer": "zero", "weights": "553000", "bits": {"fp8": "8.03"}}
    measured = sel["sensitivity"]["measured"]
    measured[groups[0]["name"]] = {"nvfp4": "0.123", "fp8": None}
    search = [*sel["search"], {"step": "4", "move": None, "mean_kld": "0.5", "accepted": "yes"}, None]
    bad = {**sel, "groups": groups, "bits_budget": "5.5", "artifact_kld": None, "additive": [1], "search": search}
    write(full_run_dir, "quantize/selection.json", bad)
    html = write_report(full_run_dir).read_text()
    auto = section(html, "auto")
    row = re.search(r"<tr><td>model\.layers\.0\.self_attn\.qkv</td>(.*?)</tr>", auto).group(1)
    assert re.findall(r'<td class="n">([^<]*)</td>', row) == ["—", "—", "—", "—", "0.0168", "—"]
    assert "0.123" not in auto and "553000" not in auto and "8.03</td>" not in row
    assert '<th>additive start (calibration text)</th><td class="n">—</td>' in auto
    trace = section(html, "search")
    last = re.findall(r"<tr>(.*?)</tr>", trace)[-1]
    assert re.findall(r"<td[^>]*>([^<]*)</td>", last) == ["—", "—", "—", "—", "—", "—", "—"]  # not "0.5", not "yes"
    assert trace.count("badge pass") == 2  # the last row is neither accepted nor rejected


def test_hostile_group_names_are_escaped(full_run_dir: Path) -> None:
    hostile = '<img src=x onerror="alert(1)">'
    sel = json.loads((full_run_dir / "quantize/selection.json").read_text())
    sel["groups"][5]["name"] = hostile
    sel["groups"][5]["format"] = "fp8"
    sel["sensitivity"]["measured"][hostile] = {"nvfp4": 0.5}
    sel["search"][1]["move"] = hostile + "→fp8"
    sel["final"]["upgraded"] = {hostile: "fp8"}
    sel["pinned"] = {"<i>fp8</i>": ["x"]}
    write(full_run_dir, "quantize/selection.json", sel)
    html = write_report(full_run_dir).read_text()
    assert "<img" not in html and "<i>fp8" not in html
    escaped = "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;"
    assert f"<tr><td>{escaped}</td>" in section(html, "auto")  # the upgraded-groups table
    chart = re.search(r'aria-label="sensitivity in nvfp4, measured vs Fisher".*?</svg>', html, re.DOTALL).group(0)
    assert "&lt;img src=x" in chart
    assert f"<td>{escaped}→fp8</td>" in section(html, "search")


def test_search_trace_marks_accepted_steps(full_run_dir: Path) -> None:
    trace = section(write_report(full_run_dir).read_text(), "search")
    verdicts = re.findall(r'<span class="badge[^"]*">(accepted|rejected)</span>', trace)
    assert verdicts == ["accepted", "rejected", "accepted", "rejected"]
    assert "2 of 4 steps accepted" in trace
    chart = re.search(r'aria-label="selection trace".*?</svg>', trace, re.DOTALL).group(0)
    assert ">search step<" in chart and ">effective bits<" not in chart
    assert "measured KLD 1: 0.215" in chart and "best KLD so far 1: 0.200" in chart
