"""examples/: the engine's API documentation runs, as a user would run it."""

import json
import runpy
import sys
from ast import literal_eval
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_engine_example_runs_on_a_checkpoint(tiny_llama: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["engine.py", str(tiny_llama)])
    runpy.run_path(str(ROOT / "examples" / "engine.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(" ", 1)[1] for line in lines[:2]] == ["length", "length"]  # greedy, 16 tokens each
    assert len(literal_eval(lines[2])) == 16  # one (token, logprob) per sampled token
    assert isinstance(json.loads(lines[3]), dict)  # the schema held
    shape = literal_eval(lines[4].rsplit(" ", 1)[0])
    config = json.loads((tiny_llama / "config.json").read_text())
    assert shape[1] == config["vocab_size"]
    stats = literal_eval(lines[5])
    assert stats["num_blocks"] == 512 and stats["num_free_blocks"] == 512  # every block freed
