"""Fixtures: hand-made run directories (see `runs.py`)."""

from pathlib import Path

import pytest

from .runs import build_run


@pytest.fixture
def full_run_dir(tmp_path: Path) -> Path:
    """Every stage done, a failing gate.json (checks FAILED_CHECKS fail)."""
    return build_run(tmp_path / "run")


@pytest.fixture
def partial_run_dir(tmp_path: Path) -> Path:
    """Only the manifest and the quantize stage; no gate.json."""
    return build_run(tmp_path / "partial", ("quantize",), with_gate=None)
