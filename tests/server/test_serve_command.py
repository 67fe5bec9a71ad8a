"""`onboard serve` with the built-in engine: the options reach the engine's config."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

import onboard.server
from onboard.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "numerics", "batch_invariant"),
    [([], "fast", True), (["--no-batch-invariant"], "fast", False), (["--numerics", "exact"], "exact", True)],
)
def test_serve_passes_numerics_and_batch_invariance(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], numerics: str, batch_invariant: bool
) -> None:
    started = {}
    monkeypatch.setattr(onboard.server, "serve", lambda model_dir, **kwargs: started.update(kwargs))
    result = runner.invoke(app, ["serve", str(tiny_llama), *args])
    assert result.exit_code == 0, result.output
    config = started["engine_config"]
    assert (config.numerics, config.batch_invariant) == (numerics, batch_invariant)
    assert started["host"] == "127.0.0.1"


def test_no_batch_invariant_is_an_option_of_the_built_in_engine_only(tiny_llama: Path) -> None:
    result = runner.invoke(app, ["serve", str(tiny_llama), "--engine", "vllm", "--no-batch-invariant"])
    assert result.exit_code != 0
    assert "--no-batch-invariant is an option of the built-in engine" in str(result.exception)
