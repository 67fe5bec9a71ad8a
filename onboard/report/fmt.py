"""Number formatting for the report: every helper takes whatever a JSON file held and returns text.

A missing or non-numeric value renders as an em dash (or as its own text), never as an exception:
the report must still render when a stage wrote something unexpected.
"""

import math
from datetime import datetime, timedelta
from typing import Any

MISSING = "—"


def is_num(value: Any) -> bool:
    """A real number (bools are not numbers here) that is finite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def num(value: Any, digits: int = 3) -> str:
    """`digits` significant digits, plain notation for everyday magnitudes, thousands separators for
    big integers."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 10**digits:
        return f"{value:,.0f}"
    if magnitude < 1e-3:
        return f"{value:.{max(digits - 1, 0)}e}"
    decimals = max(digits - 1 - math.floor(math.log10(magnitude)), 0)
    return f"{value:.{decimals}f}"


def pct(value: Any, digits: int = 1) -> str:
    """A fraction in [0, 1] as a percentage."""
    if not is_num(value):
        return num(value)
    return f"{100 * value:.{digits}f}%"


def pp(value: Any, digits: int = 1) -> str:
    """A difference of two fractions, in signed percentage points."""
    if not is_num(value):
        return num(value)
    return f"{100 * value:+.{digits}f} pp"


def mb(value: Any) -> str:
    """Bytes as MB (10^6), the unit model cards use."""
    if not is_num(value):
        return num(value)
    return f"{value / 1e6:,.1f} MB"


def secs(value: Any) -> str:
    """Seconds as s / min / h, whichever reads best."""
    if not is_num(value):
        return num(value)
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def ratio(before: Any, after: Any) -> str:
    """`before / after` as a compression factor, e.g. "2.31×"."""
    if not (is_num(before) and is_num(after)) or after == 0:
        return MISSING
    return f"{before / after:.2f}×"


def label(key: Any) -> str:
    """A JSON key as a human label: `mean_kld` -> `mean kld`."""
    return str(key).replace("_", " ")


def when(value: Any) -> str:
    """An ISO timestamp from the manifest, shown as `2026-11-30 07:13:56 UTC`."""
    if not isinstance(value, str):
        return num(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.utcoffset() == timedelta(0):
        return f"{moment:%Y-%m-%d %H:%M:%S} UTC"
    return moment.isoformat(sep=" ")
