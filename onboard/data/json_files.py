"""`.jsonl` files (one row per line) and `.json` files (a list of rows, or a mapping)."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onboard.data.failure import data_error, unreadable
from onboard.data.record import Record
from onboard.data.rows import record_from_row


def iter_jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) for every non-blank line, streamed."""
    try:
        with path.open("rb") as lines:
            for lineno, raw in enumerate(lines, start=1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise data_error(f"{path}:{lineno}: not UTF-8 text: {exc.reason}") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise data_error(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
                yield lineno, row
    except OSError as exc:
        raise unreadable(path, exc) from None


def load_jsonl(path: Path) -> list[Record]:
    records = []
    for lineno, row in iter_jsonl_rows(path):
        record = _record(row, f"{path.name}:{lineno}", f"{path}:{lineno}")
        if record is not None:
            records.append(record)
    return records


def load_json(path: Path) -> list[Record]:
    records = [_record(row, source, where) for source, where, row in json_items(path)]
    return [record for record in records if record is not None]


def json_items(path: Path) -> list[tuple[str, str, Any]]:
    """(source, where, row) of every row of a `.json` file: a list's items, or a mapping's values."""
    try:
        with path.open(encoding="utf-8-sig") as file:
            data = json.load(file)
    except json.JSONDecodeError as exc:
        raise data_error(f"{path}:{exc.lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise data_error(f"{path}: not UTF-8 text: {exc.reason}") from None
    except OSError as exc:
        raise unreadable(path, exc) from None

    if isinstance(data, list):
        items = [(f"{path.name}[{i}]", f"{path}: item {i}", row) for i, row in enumerate(data)]
    elif isinstance(data, dict):
        items = [(f"json:{key}", f"{path}: key {key!r}", row) for key, row in data.items()]
    else:
        raise data_error(f"{path}: expected a JSON list or object at the top level")
    return items


def _record(row: Any, source: str, where: str) -> Record | None:
    try:
        return record_from_row(row, source=source)
    except ValueError as exc:
        raise data_error(f"{where}: {exc}") from None
