"""Content fingerprints of the inputs a stage depends on (model, data, recipe, code)."""

import hashlib
import json
from pathlib import Path
from typing import Any

import onboard

# Checkpoints run to hundreds of GB; hashing every byte on each resume would cost minutes.
# Files above this size are fingerprinted by size, mtime and their first and last MiB.
FULL_HASH_LIMIT = 64 * 2**20
_EDGE = 2**20


def _hash_file(path: Path, digest: "hashlib._Hash") -> None:
    stat = path.stat()
    if stat.st_size <= FULL_HASH_LIMIT:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(2**20), b""):
                digest.update(block)
        return
    digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(_EDGE))
        handle.seek(-_EDGE, 2)
        digest.update(handle.read(_EDGE))


def fingerprint(path: Path) -> str:
    """sha256 of a file, or of a directory's relative paths and file contents (sorted)."""
    digest = hashlib.sha256()
    if path.is_file():
        _hash_file(path, digest)
        return digest.hexdigest()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path)
        if any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(str(relative).encode() + b"\0")
        _hash_file(file, digest)
    return digest.hexdigest()


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def code_version() -> str:
    """The package version plus a hash of its source, so an edited onboard reruns stages."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    return f"{onboard.__version__}+{digest.hexdigest()[:12]}"
