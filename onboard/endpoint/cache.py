"""Answers already received from an endpoint, on disk, so that an interrupted check resumes without
redoing finished requests.

Each answer is one file named by the hash of what was asked (endpoint, model, request), written
atomically; a half-written or unreadable file counts as not received. The cache lives outside the
stage's staging directory (a failed stage discards its staging, not this) and is removed when the
check finishes: a later run asks the server again, since the deployment may have changed. Its
`session` id goes into the stage's inputs, so that a resumed run is the same stage run.
"""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from onboard import atomic
from onboard.hashing import hash_json


class RequestCache:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def session(self) -> str:
        path = self.root / "session"
        if not path.is_file():
            atomic.write_text(path, uuid.uuid4().hex)
        return path.read_text().strip()

    def key(self, request: dict[str, Any]) -> str:
        return hash_json(request)[:32]

    def _path(self, key: str, suffix: str) -> Path:
        return self.root / key[:2] / f"{key}{suffix}"

    def get_arrays(self, key: str) -> dict[str, np.ndarray] | None:
        path = self._path(key, ".npz")
        try:
            with np.load(path) as data:
                return {name: data[name] for name in data.files}
        except (OSError, ValueError, EOFError):
            return None

    def put_arrays(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        atomic.write_bytes(self._path(key, ".npz"), buffer.getvalue())

    def get_json(self, key: str) -> Any | None:
        try:
            return json.loads(self._path(key, ".json").read_text())
        except (OSError, ValueError):
            return None

    def put_json(self, key: str, value: Any) -> None:
        atomic.write_json(self._path(key, ".json"), value)

    def clear(self) -> None:
        atomic.remove(self.root)
