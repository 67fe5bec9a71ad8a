"""docs/cli.md is every command's `--help` as the command line prints it now (scripts/cli_docs.py
writes it), whatever the terminal of whoever generates it."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cli_docs.py"


@pytest.fixture(scope="module")
def cli_docs():
    spec = importlib.util.spec_from_file_location("cli_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_the_generated_help(cli_docs) -> None:
    assert (ROOT / "docs" / "cli.md").read_text() == cli_docs.render(), (
        "docs/cli.md is out of date: run `python scripts/cli_docs.py`"
    )


def test_every_command_is_documented(cli_docs) -> None:
    from onboard.cli import app

    text = cli_docs.render()
    names = [info.name or info.callback.__name__.replace("_", "-") for info in app.registered_commands]
    assert names and all(f"\n## onboard {name}\n" in text for name in names)


def test_the_terminal_does_not_change_the_text(cli_docs, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = cli_docs.render()
    for columns in ("60", "200"):
        monkeypatch.setenv("COLUMNS", columns)
        monkeypatch.setenv("TERMINAL_WIDTH", columns)
        monkeypatch.setenv("FORCE_COLOR", "1")
        assert cli_docs.render() == expected
