"""`load_records`: every kind of DATA input, read into Records."""

import os
from collections.abc import Callable
from pathlib import Path

from onboard.data.failure import FIELD_HINT, data_error
from onboard.data.json_files import load_json, load_jsonl
from onboard.data.record import Record
from onboard.data.saved_dataset import is_saved_dataset, load_saved_dataset
from onboard.data.text_dir import EXTENSIONS, load_text_dir
from onboard.data.text_file import load_txt

FILE_LOADERS: dict[str, Callable[[Path], list[Record]]] = {
    ".jsonl": load_jsonl,
    ".json": load_json,
    ".txt": load_txt,
}


def load_records(path: str | Path) -> list[Record]:
    """Records from a `.jsonl`, `.json` or `.txt` file, a directory saved by
    `datasets.save_to_disk`, or a directory of text and source files; always in the
    same order. Raises OnboardError when there is nothing usable to read."""
    path = Path(path)
    if not path.exists():
        raise data_error(f"{path}: no such file or directory")
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise data_error(f"{path}: not readable: permission denied")
        if is_saved_dataset(path):
            records, hint = load_saved_dataset(path), FIELD_HINT
        else:
            records = load_text_dir(path)
            hint = f"expected files ending in {', '.join(sorted(EXTENSIONS))}"
    elif path.is_file():
        loader = FILE_LOADERS.get(path.suffix.lower())
        if loader is None:
            kinds = ", ".join(FILE_LOADERS)
            raise data_error(
                f"{path}: unsupported file type {path.suffix or '(no extension)'!r}: expected {kinds}, or a directory"
            )
        records = loader(path)
        hint = "the file is empty" if loader is load_txt else FIELD_HINT
    else:
        raise data_error(f"{path}: not a regular file or directory")
    if not records:
        raise data_error(f"{path} contains no usable text: {hint}")
    return records


def existing_data(path: Path | None) -> Path | None:
    """Read DATA once up front, so an empty or unreadable file fails before any stage starts."""
    if path is not None:
        load_records(path)
    return path
