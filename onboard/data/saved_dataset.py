"""A directory written by `datasets.Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onboard.data.failure import data_error
from onboard.data.record import Record
from onboard.data.rows import record_from_row


def is_saved_dataset(path: Path) -> bool:
    # The same marker files `datasets.load_from_disk` itself checks for.
    dataset = (path / "dataset_info.json").is_file() and (path / "state.json").is_file()
    return dataset or (path / "dataset_dict.json").is_file()


def load_saved_dataset(path: Path) -> list[Record]:
    """Rows read like `.jsonl` rows; of a DatasetDict, the "train" split if there is one,
    else the first."""
    records = []
    for source, where, row in saved_rows(path):
        try:
            record = record_from_row(row, source=source)
        except ValueError as exc:
            raise data_error(f"{where}: {exc}") from None
        if record is not None:
            records.append(record)
    return records


def saved_rows(path: Path) -> Iterator[tuple[str, str, Any]]:
    """(source, where, row) of every row of the saved dataset (of a DatasetDict, the "train"
    split if there is one, else the first)."""
    import datasets  # slow to import, and only this kind of input needs it

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many kinds for a damaged directory
        raise data_error(f"{path}: cannot load saved dataset: {_first_line(exc)}") from None
    split = None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            return
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    label = f"{path.name}[{split}]" if split else path.name
    for i, row in enumerate(loaded):
        where = f"split {split!r} row {i}" if split else f"row {i}"
        yield f"{label}:{i}", f"{path}: {where}", row


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
