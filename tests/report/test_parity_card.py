"""The engine-parity card's fast-numerics table from adapt/parity.json's `fast` block: fast's
figures beside exact's floor, and nothing of it in a run older than the block."""

import json
import re
from pathlib import Path

from onboard.report import write_report

from .runs import write
from .test_report import section

FAST_TITLE = "fast numerics (the default for serve, smoke and the speculator's data)"


def _fast_rows(card: str) -> list[list[str]]:
    table = re.search(rf"<h3>{re.escape(FAST_TITLE)}</h3>\s*<table>(.*?)</table>", card, re.DOTALL)
    assert table, "no fast-numerics table"
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(1), re.DOTALL)
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row) for row in rows]


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
