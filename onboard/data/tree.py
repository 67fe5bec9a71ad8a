"""The files under a directory, the way every directory reader here sees them."""

import os
from pathlib import Path

from onboard.data.failure import unreadable

SKIPPED_DIRS = frozenset({"__pycache__"})


def tree_files(root: Path) -> list[Path]:
    """Every regular file under `root`, recursively, sorted by relative path. Hidden
    entries and `__pycache__` are left out: they are tool state, not content."""
    files = []

    def fail(exc: OSError) -> None:
        raise unreadable(Path(exc.filename or root), exc)

    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIPPED_DIRS]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.is_file():
                files.append(path)
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())
