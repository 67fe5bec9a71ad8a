"""The engine-parity card's fast-numerics table from adapt/parity.json's `fast` block: fast's
figures beside exact's floor, and nothing of it in a run older than the block.  Then the parity
rule the run was judged by and, for an artifact with 4-bit activations (`layerwise_distribution`),
the distribution figures of both numerics and the layerwise rule's worst layer."""

import json
import re
from pathlib import Path
from typing import Any

import pytest
from parity_files import EXACT_DISTRIBUTION, FAST_DISTRIBUTION, layer_entry, layerwise_block

from onboard.report import write_report

from .runs import parity, write
from .test_report import section

FAST_TITLE = "fast numerics (the default for serve, smoke and the speculator's data)"
DISTRIBUTION_TITLE = "distribution rule (against transformers and the unquantized source)"
LAYERWISE_TITLE = "layerwise rule (each decoder layer on transformers' own input)"


def _table_rows(card: str, title: str) -> list[list[str]]:
    table = re.search(rf"<h3>{re.escape(title)}</h3>.*?<table[^>]*>(.*?)</table>", card, re.DOTALL)
    assert table, f"no table under {title!r}"
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(1), re.DOTALL)
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row) for row in rows]


def _fast_rows(card: str) -> list[list[str]]:
    return _table_rows(card, FAST_TITLE)


def _kv(card: str) -> dict[str, str]:
    """The card's first key-value table (the exact figures)."""
    table = re.search(r'<table class="kv">(.*?)</table>', card, re.DOTALL)
    assert table, "no key-value table"
    return dict(re.findall(r"<tr><th>(.*?)</th><td[^>]*>(.*?)</td></tr>", table.group(1)))


def test_fast_figures_beside_the_exact_floor(full_run_dir: Path) -> None:
    rows = _fast_rows(section(write_report(full_run_dir).read_text(), "parity"))
    assert rows == [
        ["measure", "fast", "exact (floor)"],
        ["top-1 agreement at decode steps", "98.6%", "98.3%"],
        ["max |Δ logprob| at decode steps", "0.157", "0.205"],
        ["greedy match rate", "37.5%", ""],
        ["logprobs close (near-tie rule)", "yes", ""],
        ["decode positions", "1,014", ""],
    ]


def test_missing_fast_keys_render_as_dashes(full_run_dir: Path) -> None:
    path = full_run_dir / "adapt/parity.json"
    data = json.loads(path.read_text())
    data["fast"] = {"greedy_match_rate": 0.5, "logprobs_close": False}
    write(full_run_dir, "adapt/parity.json", data)
    rows = _fast_rows(section(write_report(full_run_dir).read_text(), "parity"))
    assert rows[1][1:] == ["—", "—"] and rows[3][1] == "50.0%" and rows[4][1] == "no"


def test_a_run_without_the_fast_block_shows_no_fast_table(full_run_dir: Path) -> None:
    path = full_run_dir / "adapt/parity.json"
    data = json.loads(path.read_text())
    del data["fast"]
    write(full_run_dir, "adapt/parity.json", data)
    card = section(write_report(full_run_dir).read_text(), "parity")
    assert "fast numerics" not in card and "decode steps" not in card
    assert "greedy match rate" in card and "<h3>Cases</h3>" in card  # the exact figures are still there


def w4a4_parity() -> dict[str, Any]:
    """parity.json of an NVFP4 W4A4 artifact (rule `layerwise_distribution`), every rule passing;
    the worst layer by floor ratio (1) is not the one with the largest linear ratio (2)."""
    data = parity()
    data["rule"] = "layerwise_distribution"
    data["distribution"] = dict(EXACT_DISTRIBUTION)
    data["fast"]["distribution"] = dict(FAST_DISTRIBUTION)
    data["layerwise"] = layerwise_block(
        [
            layer_entry(0, 1.1, 0.003, "self_attn.o_proj"),
            layer_entry(1, 1.6, 0.05, "self_attn.q_proj"),
            layer_entry(2, 1.2, 0.41, "mlp.down_proj"),
        ]
    )
    return data


def _card(run: Path, data: dict[str, Any]) -> str:
    write(run, "adapt/parity.json", data)
    return section(write_report(run).read_text(), "parity")


def test_w4a4_card_shows_the_rule_both_distributions_and_the_worstlayer_entry(full_run_dir: Path) -> None:
    card = _card(full_run_dir, w4a4_parity())
    assert _kv(card)["parity rule"].startswith("layerwise_distribution (4-bit activations")
    assert "shown, not gated" in card
    assert _table_rows(card, DISTRIBUTION_TITLE) == [
        ["measure", "exact", "fast"],
        ["KL(transformers‖engine) ÷ the one-ulp floor", "0.00200", "0.300"],
        ["KL(transformers‖engine)", "1.00e-04", "0.0150"],
        ["KL(transformers‖transformers, inputs moved one ulp): the floor", "0.0500", "0.0500"],
        ["KL(source‖transformers): the damage transformers measures", "0.0500", "0.0500"],
        ["KL(source‖engine): the damage the engine serves", "0.0510", "0.0504"],
        ["damage difference (± standard error)", "2.10% ± 1.10%", "0.80% ± 1.20%"],
        ["positions", "512", "512"],
    ]
    assert _table_rows(card, LAYERWISE_TITLE) == [
        ["checked", "3 decoder layers and the head on 512 tokens"],
        ["worst layer", "model.layers.1"],
        ["its RMS error ÷ floor", "1.60 (allowed ≤ 4.00)"],
        ["its worst linear ÷ rounding step", "0.0500 (model.layers.1.self_attn.q_proj)"],
        ["largest linear ÷ rounding step, any layer", "0.410 (allowed ≤ 2.00)"],
        ["passed", "yes"],
    ]
    assert "first failing" not in card  # only when the layerwise rule failed
    assert _fast_rows(card)[1] == ["top-1 agreement at decode steps", "98.6%", "98.3%"]  # still there


def test_failed_layerwise_names_the_first_failing_layer_and_module(full_run_dir: Path) -> None:
    """A 5 % scaled o_proj in layer 2: its layer 4.6 times its floor, the linear 8.7 times its step."""
    data = w4a4_parity()
    layerwise = data["layerwise"]
    layerwise["layers"][2] = layer_entry(2, 4.6, 8.7, "self_attn.o_proj")
    layerwise.update(
        max_floor_ratio=4.6,
        max_linear_ratio=8.7,
        passed=False,
        first_failing_layer="model.layers.2",
        first_failing_module="model.layers.2.self_attn.o_proj",
    )
    rows = dict(map(tuple, _table_rows(_card(full_run_dir, data), LAYERWISE_TITLE)))
    assert rows["worst layer"] == "model.layers.2"
    assert rows["its RMS error ÷ floor"] == "4.60 (allowed ≤ 4.00)"
    assert rows["its worst linear ÷ rounding step"] == "8.70 (model.layers.2.self_attn.o_proj)"
    assert rows["largest linear ÷ rounding step, any layer"] == "8.70 (allowed ≤ 2.00)"
    assert rows["passed"] == "no"
    assert rows["first failing layer"] == "model.layers.2"
    assert rows["first failing module"] == "model.layers.2.self_attn.o_proj"


def test_the_head_as_worst_layer_has_no_linear(full_run_dir: Path) -> None:
    data = w4a4_parity()
    data["layerwise"]["head"]["floor_ratio"] = 5.0
    data["layerwise"].update(passed=False, first_failing_layer="head", first_failing_module=None)
    rows = dict(map(tuple, _table_rows(_card(full_run_dir, data), LAYERWISE_TITLE)))
    assert rows["worst layer"] == "head"
    assert rows["its worst linear ÷ rounding step"] == "—"
    assert rows["first failing layer"] == "head"
    assert rows["first failing module"] == "—"


@pytest.mark.parametrize(
    ("rule", "shown"),
    [
        ("bitwise", "bitwise (every logit and greedy token transformers&#39; own)"),
        ("near_tie", "near_tie (greedy text parts from transformers&#39; only at near-ties)"),
        ("<b>w4a4</b>", "&lt;b&gt;w4a4&lt;/b&gt; (unknown rule)"),
    ],
)
def test_token_rule_card_shows_its_rule_and_no_distribution(full_run_dir: Path, rule: str, shown: str) -> None:
    data = parity()
    data["rule"] = rule
    card = _card(full_run_dir, data)
    assert _kv(card)["parity rule"] == shown
    assert "distribution rule" not in card and "layerwise rule" not in card and "not gated" not in card


def test_an_old_parity_file_still_renders(full_run_dir: Path) -> None:
    """parity.json from before the rule key (and before the fast block): the near-tie rule, noted."""
    data = parity()
    del data["fast"]
    assert "rule" not in data
    card = _card(full_run_dir, data)
    assert _kv(card)["parity rule"].startswith("near_tie (")
    assert "predates the rule key" in card
    assert _kv(card)["greedy match rate"] == "50.0%"
    for absent in ("distribution rule", "layerwise rule", "fast numerics", "KL(source"):
        assert absent not in card


def test_one_numerics_distribution_and_odd_values_render_as_dashes(full_run_dir: Path) -> None:
    """Only exact's distribution, a layerwise block with junk in it: dashes, not an exception."""
    data = w4a4_parity()
    del data["fast"]["distribution"]
    del data["distribution"]["damage_diff_se"]
    data["distribution"]["kl_ratio"] = None
    data["layerwise"] = {"layers": ["junk", {"layer": "model.layers.0", "floor_ratio": "high"}], "passed": None}
    card = _card(full_run_dir, data)
    rows = _table_rows(card, DISTRIBUTION_TITLE)
    assert rows[1] == ["KL(transformers‖engine) ÷ the one-ulp floor", "—", "—"]
    assert rows[6] == ["damage difference (± standard error)", "2.10%", "—"]
    layer_rows = dict(map(tuple, _table_rows(card, LAYERWISE_TITLE)))
    assert layer_rows["worst layer"] == "—"
    assert layer_rows["first failing layer"] == "—"
