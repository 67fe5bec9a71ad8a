"""Atomic writes: a reader (or a resumed run) sees the old file or the new one, never half.

Every artifact onboard writes goes through these helpers or through a staging directory that
is renamed into place (see `workspace.py`); `os.replace` is atomic on POSIX within one
filesystem, and the fsyncs make the rename durable across a power cut as well as a SIGKILL.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_tree(staged: Path, final: Path) -> None:
    """Move a finished staged file or directory over `final` (removing what was there)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # Renaming the old tree aside first keeps the window where neither exists to one rename.
        graveyard = final.with_name(f".{final.name}.old-{os.getpid()}")
        remove(graveyard)
        os.replace(final, graveyard)
        os.replace(staged, final)
        remove(graveyard)
    else:
        os.replace(staged, final)
    fsync_dir(final.parent)
