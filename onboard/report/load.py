"""Reading a (possibly partial) run directory: JSON files that may be missing or malformed."""

import json
from pathlib import Path
from typing import Any

from onboard.workspace import MANIFEST

STAGES = ("quantize", "eval", "speculator", "adapt", "smoke")


class Run:
    """The run directory plus the problems met while reading it (shown in the report's footer)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.problems: list[str] = []
        self._cache: dict[str, dict[str, Any] | None] = {}
        self.manifest = self.json(MANIFEST)

    def json(self, rel: str) -> dict[str, Any] | None:
        """The object in `rel`, or None when the file is absent or unreadable (noted in `problems`).
        Read once: several cards quote the same file."""
        if rel not in self._cache:
            self._cache[rel] = self._read(rel)
        return self._cache[rel]

    def _read(self, rel: str) -> dict[str, Any] | None:
        path = self.dir / rel
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            self.problems.append(f"{rel}: unreadable ({exc})")
            return None
        if not isinstance(data, dict):
            self.problems.append(f"{rel}: expected a JSON object, found {type(data).__name__}")
            return None
        return data

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        stages = (self.manifest or {}).get("stages")
        if not isinstance(stages, dict):
            return {}
        return {name: info for name, info in stages.items() if isinstance(info, dict)}

    def stage(self, name: str) -> dict[str, Any]:
        return self.stages.get(name, {})

    def metrics(self, name: str) -> dict[str, Any]:
        metrics = self.stage(name).get("metrics")
        return metrics if isinstance(metrics, dict) else {}

    def status(self, name: str, has_output: bool) -> str:
        """The manifest's status for a stage; "done" when only its output file is there; else "not run"."""
        status = self.stage(name).get("status")
        if isinstance(status, str) and status:
            return status
        return "done" if has_output else "not run"


def section(run: Run, stage: str, data: dict[str, Any] | None, **content: Any) -> dict[str, Any]:
    """The common shape of one card: status badge, error text, whether there is data, and content."""
    info = run.stage(stage)
    error = info.get("error")
    return {
        "status": run.status(stage, data is not None),
        "error": str(error) if error else None,
        "seconds": info.get("seconds"),
        "present": data is not None,
        **content,
    }


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
