"""Content hashes of DATA inputs, so a stage reruns when, and only when, its data changed."""

import hashlib
from pathlib import Path

from onboard.data.failure import data_error, unreadable
from onboard.data.tree import tree_files


def fingerprint_path(path: str | Path) -> str:
    """sha256 hex of a file's bytes; for a directory, of every file's relative path and
    bytes in sorted order (the files `load_records` could read: hidden entries and
    `__pycache__` are left out, so tool state does not change the hash)."""
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    if path.is_dir():
        digest = hashlib.sha256()
        for file in tree_files(path):
            # Hash of hashes, each entry delimited, so no two trees can feed the same bytes.
            relative = file.relative_to(path).as_posix()
            digest.update(f"{relative}\0{_file_digest(file)}\n".encode())
        return digest.hexdigest()
    if path.exists():
        raise data_error(f"{path}: not a regular file or directory")
    raise data_error(f"{path}: no such file or directory")


def _file_digest(path: Path) -> str:
    try:
        with path.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as exc:
        raise unreadable(path, exc) from None
