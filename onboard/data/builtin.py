"""The project's own traffic sets: `calibration_data/*.jsonl`, plus standard-library source
for code.

Every row carries an `id`; `holdout.split_of(id)` holds about one row in four out of
calibration, for evaluation, so no row is ever both calibrated on and scored.
"""

from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path

from onboard.data.failure import data_error
from onboard.data.holdout import SPLITS, Split, split_of
from onboard.data.json_files import iter_jsonl_rows
from onboard.data.record import Record
from onboard.data.rows import record_from_row
from onboard.data.stdlib_code import stdlib_code_records
from onboard.paths import CALIBRATION_DIR

TRAFFIC_TYPES = ("chat", "code", "math", "summarization", "structured")
STDLIB_CODE_FILES = 32


def builtin_records(
    split: Split,
    traffic: Sequence[str] | None = None,
    *,
    root: Path = CALIBRATION_DIR,
    stdlib_files: int = STDLIB_CODE_FILES,
) -> list[Record]:
    """The split's records of the chosen traffic types (all when None), interleaved
    round-robin in TRAFFIC_TYPES order so that any prefix of the list mixes every type.
    "code" also gets up to `stdlib_files` standard-library modules."""
    if split not in SPLITS:
        raise data_error(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    wanted = _wanted(traffic)
    groups: dict[str, list[Record]] = {name: [] for name in wanted}
    for record in _rows(root, split):
        if record.traffic in groups:
            groups[record.traffic].append(record)
    if "code" in groups:
        groups["code"] += stdlib_code_records(split, stdlib_files)
    for name, records in groups.items():
        if not records:
            raise data_error(f"{root}: no built-in {name!r} records in the {split!r} split")
    rounds = zip_longest(*groups.values())
    return [record for batch in rounds for record in batch if record is not None]


def _wanted(traffic: Sequence[str] | None) -> list[str]:
    if traffic is None:
        return list(TRAFFIC_TYPES)
    names = [traffic] if isinstance(traffic, str) else list(traffic)
    unknown = [name for name in names if name not in TRAFFIC_TYPES]
    if unknown or not names:
        what = f"unknown traffic type {unknown[0]!r}" if unknown else "no traffic type given"
        raise data_error(f"{what}: expected one of {', '.join(TRAFFIC_TYPES)}")
    return [name for name in TRAFFIC_TYPES if name in names]


def _rows(root: Path, split: Split) -> list[Record]:
    """Records of the split from every `*.jsonl` under `root`, in file then line order. A
    row without a `traffic` field takes its file's name (`math.jsonl` → "math")."""
    files = sorted(root.glob("*.jsonl"))
    if not files:
        raise data_error(f"{root}: no built-in traffic files (*.jsonl)")
    first_seen: dict[str, str] = {}
    records = []
    for file in files:
        for lineno, row in iter_jsonl_rows(file):
            where = f"{file}:{lineno}"
            row_id = row.get("id") if isinstance(row, dict) else None
            if row_id is None or row_id == "":
                raise data_error(f"{where}: a built-in row needs an 'id'")
            key = str(row_id)
            if key in first_seen:
                raise data_error(f"{where}: id {key!r} repeats the one at {first_seen[key]}")
            first_seen[key] = where
            try:
                record = record_from_row(row, source=f"{file.name}:{lineno}", traffic=file.stem)
            except ValueError as exc:
                raise data_error(f"{where}: {exc}") from None
            if record is not None and record.traffic not in TRAFFIC_TYPES:
                raise data_error(
                    f"{where}: unknown traffic type {record.traffic!r}: expected one of {', '.join(TRAFFIC_TYPES)}"
                )
            if record is not None and split_of(key) == split:
                records.append(record)
    return records
