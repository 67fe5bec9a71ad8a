"""Code traffic from the Python standard library's own source, read where it is installed
(never copied into the repository)."""

import sysconfig
from pathlib import Path

from onboard.data.holdout import Split, split_of
from onboard.data.record import Record

MIN_BYTES = 1024  # stubs and one-liners teach nothing about code
MAX_BYTES = 40 * 1024  # a calibration window only sees the start of anything longer


def stdlib_code_records(split: Split, limit: int, *, root: Path | None = None) -> list[Record]:
    """Up to `limit` top-level `*.py` files of the standard library (`root`, by default the
    running interpreter's), sorted by name, of the given split; one record each."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    records: list[Record] = []
    for path in sorted(root.glob("*.py")):
        if len(records) >= limit:
            break
        if path.name.startswith("test") or split_of(path.name) != split:
            continue
        try:
            if not MIN_BYTES <= path.stat().st_size <= MAX_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an odd installation loses a file of extra data, nothing more
        records.append(Record(traffic="code", source=f"stdlib:{path.name}", text=text))
    return records
