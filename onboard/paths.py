"""Where onboard keeps things: the project's shipped data and the user's cache."""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = PROJECT_ROOT / "recipes"
CALIBRATION_DIR = PROJECT_ROOT / "calibration_data"


def cache_dir() -> Path:
    """`$ONBOARD_CACHE`, else `$XDG_CACHE_HOME/onboard`, else `~/.cache/onboard`."""
    if explicit := os.environ.get("ONBOARD_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "onboard"
