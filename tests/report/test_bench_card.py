"""The report's throughput card from bench/bench.json: one row per concurrency, every side, the
fast engine's ratios to transformers and llama.cpp, and the reason when llama.cpp was skipped."""

import json
import re
from pathlib import Path

from onboard.report import write_report
from onboard.report.load import Run
from onboard.report.runinfo import bench

from .runs import write
from .test_report import section


def _cells(html: str) -> list[list[str]]:
    rows = re.findall(r"<tr>(.*?)</tr>", html, re.DOTALL)
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row) for row in rows]


def test_card_has_a_row_per_concurrency_with_every_side(full_run_dir: Path) -> None:
    card = bench(Run(full_run_dir))
    assert card["columns"] == [
        "transformers",
        "engine exact",
        "engine fast",
        "engine fast, not batch invariant",
        "llama.cpp",
    ]
    assert [r["concurrency"] for r in card["rows"]] == [1, 16, 64]
    one, sixteen, _ = card["rows"]
    assert one["tps"] == [13.5, 40.1, 45.2, 61.5, 111.0]
    assert one["fast_over_hf"] == 45.2 / 13.5 and one["fast_over_llama_cpp"] == 45.2 / 111.0
    assert sixteen["tps"][4] is None and sixteen["fast_over_llama_cpp"] is None  # llama.cpp runs at c=1 only
    assert not any(re.fullmatch(r".*_c\d+_tps|fast_over_.*", k) for k in card["other"])  # shown in the rows
    assert card["other"]["prefix_ttft_warm_s"] == 0.11

    cells = _cells(section(write_report(full_run_dir).read_text(), "bench"))
    assert cells[0][-2:] == ["engine fast / transformers", "engine fast / llama.cpp"]
    assert cells[1] == ["1", "13.5", "40.1", "45.2", "61.5", "111", "3.35×", "0.407×"]
    assert cells[2][5:] == ["—", "6.83×", "—"]


def test_card_says_why_llama_cpp_was_skipped_escaped(full_run_dir: Path) -> None:
    path = full_run_dir / "bench/bench.json"
    data = json.loads(path.read_text())
    data |= {"llama_cpp_c1_tps": None, "fast_over_llama_cpp_c1": None, "llama_cpp_skipped": "not <b>installed</b>"}
    write(full_run_dir, "bench/bench.json", data)
    html = section(write_report(full_run_dir).read_text(), "bench")
    assert "llama.cpp skipped: not &lt;b&gt;installed&lt;/b&gt;" in html
    assert _cells(html)[1][5:] == ["—", "3.35×", "—"]


def test_an_old_bench_json_still_shows_its_figures(full_run_dir: Path) -> None:
    write(full_run_dir, "bench/bench.json", {"engine_c1_tps": 45.2, "hf_c1_tps": 13.5})
    card = bench(Run(full_run_dir))
    assert [r["concurrency"] for r in card["rows"]] == [1]
    assert card["rows"][0]["tps"] == [13.5, None, None, None, None] and card["other"] == {"engine_c1_tps": 45.2}
    assert "engine c1 tps" in section(write_report(full_run_dir).read_text(), "bench")
