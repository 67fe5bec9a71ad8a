"""What the suite builds once per test run and shares: tiny checkpoints and quantized runs.

A build lives in a directory of the run's pytest temp root named by its key, which is everything
that determines it (the builder's name and settings; the code is the run's own). Under
pytest-xdist every worker sees the same root: the first to ask builds under a file lock, the
others wait and reuse, so nothing is built twice in one run. Nothing outlives the run, so no
cache can hide a change to the code that built it.

Shared builds are read-only: a test that writes into a run directory (further stages, a
corrupted file, even `RunDir`'s lock file) takes `copy_of` it first.
"""

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """This run's temp root, the same for every xdist worker (each gets a `popen-gwN` below it)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(factory: pytest.TempPathFactory, key: str, build: Callable[[Path], object]) -> Path:
    """The directory `build(directory)` filled for `key`, built by the first caller in this run."""
    root = shared_root(factory) / "shared"
    root.mkdir(exist_ok=True)
    target, done = root / key, root / f"{key}.done"
    with FileLock(str(root / f"{key}.lock")):
        if not done.exists():  # built in place: a run directory records its own path
            shutil.rmtree(target, ignore_errors=True)  # a worker that failed mid-build
            target.mkdir()
            build(target)
            done.touch()
    return target


def copy_of(shared: Path, destination: Path) -> Path:
    """A private copy of a shared build, for a test that writes into it."""
    return Path(shutil.copytree(shared, destination))


def settings_key(name: str, settings: str) -> str:
    """`name` plus a digest of `settings` (a JSON dump): one directory per distinct build."""
    return f"{name}-{hashlib.sha256(settings.encode()).hexdigest()[:16]}"
