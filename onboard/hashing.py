"""Content fingerprints of the inputs a stage depends on (model, data, recipe, code)."""

import hashlib
import json
from pathlib import Path
from typing import Any

import onboard
from onboard.data.failure import data_error, unreadable
from onboard.data.tree import tree_files

# Checkpoints run to hundreds of GB; hashing every byte on each resume would cost minutes.
# Files above this size are fingerprinted by size, mtime and their first and last MiB.
FULL_HASH_LIMIT = 64 * 2**20
_EDGE = 2**20


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            if size <= FULL_HASH_LIMIT:
                return hashlib.file_digest(handle, "sha256").hexdigest()
            digest.update(f"{size}:{path.stat().st_mtime_ns}".encode())
            digest.update(handle.read(_EDGE))
            handle.seek(-_EDGE, 2)
            digest.update(handle.read(_EDGE))
    except OSError as exc:
        raise unreadable(path, exc) from None
    return digest.hexdigest()


def fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes; for a directory, of every file's relative path and digest in
    sorted order (hidden entries and `__pycache__` are tool state and left out)."""
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    if path.is_dir():
        digest = hashlib.sha256()
        for file in tree_files(path):
            # A hash of delimited (path, hash) entries: no two trees can feed the same bytes.
            digest.update(f"{file.relative_to(path).as_posix()}\0{_file_digest(file)}\n".encode())
        return digest.hexdigest()
    if path.exists():
        raise data_error(f"{path}: not a regular file or directory")
    raise data_error(f"{path}: no such file or directory")


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def code_version() -> str:
    """The package version plus a hash of its source, so an edited onboard reruns stages."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    return f"{onboard.__version__}+{digest.hexdigest()[:12]}"
