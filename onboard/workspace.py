"""The run directory: its manifest, one lock per run, and resumable, atomic stages.

A stage writes everything into `RUN_DIR/.staging/<stage>/` laid out as the run directory
itself; only when its body returns are the outputs renamed into place and the manifest marked
`done`. The manifest entry is the commit point: a stage killed at any moment (SIGKILL
included) is still `running` there, so the next invocation discards the leftovers and redoes
it, and no artifact that looks finished can be half-written.
"""

import fcntl
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from safetensors import SafetensorError

from onboard import atomic, pagecache
from onboard.console import console as _console  # private here: its one home is onboard.console
from onboard.errors import OnboardError
from onboard.hashing import code_version, fingerprint, hash_json
from onboard.recipes import Recipe, describe

# The run directory's layout: the one place a path into a run is spelled (tests/test_layout.py
# checks that no other module spells one). Each stage writes under its own folder; endpoint
# results repeat a stage's layout under endpoints/NAME/.
MANIFEST = "manifest.json"
ARTIFACT = "artifact"
DRAFT = "artifact/speculator"
SELECTION = "quantize/selection.json"
KL = "eval/kl.json"
SPECULATOR_METRICS = "speculator/metrics.json"
SPECULATOR_TRAIN = "speculator/train.json"
SPECULATOR_DATA = "speculator/data"
SPECULATOR_WORK = "speculator-work"
PARITY = "adapt/parity.json"
LAYERWISE = "adapt/layerwise.json"
SMOKE = "smoke/smoke.json"
BENCH = "bench/bench.json"
REPORT = "report.html"
GATE = "gate.json"
SERVE = "serve"
ENDPOINTS = "endpoints"
CACHE = ".cache"
STAGING = ".staging"


@dataclass(frozen=True)
class RunFile:
    path: str
    written_by: str
    holds: str


# What the README's run-directory listing shows (tests/test_layout.py keeps the two equal).
LAYOUT = (
    RunFile(MANIFEST, "every command", "each stage's status, inputs, fingerprints, metrics and time; the recipe"),
    RunFile(ARTIFACT, "onboard quantize", "the compressed-tensors checkpoint vLLM and SGLang load"),
    RunFile(DRAFT, "onboard speculator", "the EAGLE-3 draft (speculators format)"),
    RunFile(SELECTION, "onboard quantize", "the format each linear got, and why"),
    RunFile(KL, "onboard eval", "KL divergence and top-1 agreement against the source, per layer too"),
    RunFile(SPECULATOR_METRICS, "onboard speculator", "acceptance length and rate on held-out prompts"),
    RunFile(SPECULATOR_TRAIN, "onboard speculator", "the draft's training curve"),
    RunFile(SPECULATOR_DATA, "onboard speculator", "the captured responses and hidden states it trained on"),
    RunFile(PARITY, "onboard adapt", "the engine against transformers: logits, greedy continuations, the rule"),
    RunFile(LAYERWISE, "onboard adapt --layerwise", "each decoder layer against transformers'"),
    RunFile(SMOKE, "onboard smoke", "loops, repetition, entropy and batch invariance against the source"),
    RunFile(BENCH, "onboard bench RUN_DIR", "tokens/s against transformers and llama.cpp"),
    RunFile(REPORT, "onboard report", "one self-contained page"),
    RunFile(GATE, "onboard gate", "each release check, its value and threshold"),
    RunFile(SERVE, "onboard serve --engine vllm|sglang", "the production launch command"),
    RunFile(ENDPOINTS, "eval, speculator, smoke --endpoint", "a server's results, laid out as the run's own"),
)


def folder(relative: str) -> str:
    """The stage folder a layout path lies in (`eval` for eval/kl.json)."""
    return relative.partition("/")[0]


def at_endpoint(slug: str, relative: str) -> str:
    """Where a server's result lies: `relative` under endpoints/SLUG/."""
    return f"{ENDPOINTS}/{slug}/{relative}"


_PACKAGES = ("torch", "transformers", "llmcompressor", "compressed-tensors", "onboard")


def package_versions() -> dict[str, str]:
    """The versions of what an artifact or a measurement depends on (Python and the packages)."""
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Stage:
    """Handed to a stage body: where to write, and what it records in the manifest."""

    name: str
    staging: Path
    run: "RunDir"
    metrics: dict[str, Any] = field(default_factory=dict)

    def path(self, relative: str) -> Path:
        """Where to write the output that will end up at `RUN_DIR/relative`."""
        target = self.staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        return target


class RunDir:
    """One onboarding run. Use as a context manager: it holds the run's lock."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise OnboardError(f"output directory {self.root} exists and is not a directory")
        self._lock_handle = None

    def __enter__(self) -> "RunDir":
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_handle = open(self.root / ".lock", "a+")
        except OSError as err:
            raise OnboardError(f"cannot use {self.root} as a run directory: {err.strerror}") from err
        try:
            fcntl.flock(self._lock_handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            self._lock_handle.close()
            self._lock_handle = None
            raise OnboardError(f"{self.root} is in use by another onboard process") from err
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock_handle is not None:
            fcntl.flock(self._lock_handle, fcntl.LOCK_UN)
            self._lock_handle.close()

    @classmethod
    def open(cls, root: Path) -> "RunDir":
        """An existing run directory, or the one refusal for a path that is not one."""
        if not is_run(root):
            raise OnboardError(
                f"{root} is not a run directory (no {MANIFEST}); run `onboard quantize` or `onboard run` first"
            )
        return cls(root)

    @property
    def artifact(self) -> Path:
        return self.root / ARTIFACT

    def path(self, relative: str) -> Path:
        """A layout path (this module's constants) in this run."""
        return self.root / relative

    @property
    def source(self) -> Path | None:
        """The checkpoint the quantize stage read (the run's unquantized model), None before it ran."""
        entry = self.stage_entry("quantize")
        path = (entry or {}).get("inputs", {}).get("model_path")
        return Path(path) if path else None

    def manifest(self) -> dict[str, Any]:
        return read_manifest(self.root)

    def _save(self, manifest: dict[str, Any]) -> None:
        manifest["versions"] = package_versions()
        atomic.write_json(self.root / MANIFEST, manifest)

    def record_recipe(self, recipe: Recipe) -> None:
        """The recipe this run uses, CLI overrides applied; later commands read it back."""
        manifest = self.manifest()
        manifest["recipe"] = recipe.model_dump()
        self._save(manifest)

    def record_skipped(self, name: str, reason: str) -> None:
        """`name` did not run, and why (a finished run of it stays: its results still stand)."""
        manifest = self.manifest()
        if (manifest["stages"].get(name) or {}).get("status") != "done":
            manifest["stages"][name] = {"status": "skipped", "reason": reason, "finished": _now()}
            self._save(manifest)

    def recipe(self) -> Recipe:
        recorded = self.manifest().get("recipe")
        try:
            return Recipe.model_validate(recorded) if recorded else Recipe()
        except ValidationError as err:
            raise OnboardError(f"{self.root / MANIFEST}: the recorded recipe is invalid: {describe(err)}") from err

    def stage_entry(self, name: str) -> dict[str, Any] | None:
        return self.manifest()["stages"].get(name)

    def require(self, name: str) -> dict[str, Any]:
        entry = self.stage_entry(name)
        if not entry or entry.get("status") != "done":
            raise OnboardError(f"{self.root} has no finished '{name}' stage; run `onboard {name}` first")
        return entry

    def cached(self, name: str, inputs: dict[str, Any], outputs: list[str]) -> dict[str, Any] | None:
        """The entry of a finished run of `name` with these inputs and its outputs in place, else None."""
        key = hash_json({**inputs, "code": code_version()})
        previous = self.manifest()["stages"].get(name)
        if (
            previous
            and previous.get("status") == "done"
            and previous.get("key") == key
            and all((self.root / out).exists() for out in outputs)
        ):
            return previous
        return None

    def run_stage(
        self,
        name: str,
        inputs: dict[str, Any],
        outputs: list[str],
        body: Callable[[Stage], dict[str, Any]],
    ) -> dict[str, Any]:
        """Run `body` unless a finished run with the same inputs is recorded; return its entry."""
        cached = self.cached(name, inputs, outputs)
        if cached is not None:
            _console.print(f"[bold]{name}[/]: cached, inputs unchanged ({self.root / MANIFEST})")
            return cached
        inputs = {**inputs, "code": code_version()}
        key = hash_json(inputs)
        manifest = self.manifest()
        previous = manifest["stages"].get(name)
        if previous and previous.get("status") == "running":
            _console.print(f"[yellow]{name}[/]: an earlier run did not finish; redoing it")

        staging = self.root / STAGING / name
        atomic.remove(staging)
        for out in outputs:  # trees a killed replace_tree had set aside
            for stale in self.root.glob(f".{Path(out).name}.old-*"):
                atomic.remove(stale)
        staging.mkdir(parents=True)
        entry = {"status": "running", "key": key, "inputs": inputs, "started": _now()}
        manifest["stages"][name] = entry
        self._save(manifest)

        stage = Stage(name=name, staging=staging, run=self)
        start = time.perf_counter()
        # What the stage writes is written back and what it reads dropped as it goes: a container's
        # memory limit counts the page cache (`pagecache.py`).
        source = Path(inputs["model_path"]) if inputs.get("model_path") else self.source
        read = [p for p in (source, self.root / ARTIFACT) if p is not None and p.exists()]
        try:
            with pagecache.bounded(written=[staging], read=read):
                metrics = body(stage)
            for out in outputs:
                staged = staging / out
                if not staged.exists():
                    raise RuntimeError(f"stage {name} did not write {out}")
                atomic.replace_tree(staged, self.root / out)
        except (OSError, SafetensorError) as err:
            # A full disk or a write limit surfaces as OSError, or from safetensors' Rust writer
            # as SafetensorError; either way nothing was renamed into place.
            self._fail(name, entry, err)
            where = f" ({err.filename})" if getattr(err, "filename", None) else ""
            reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
            raise OnboardError(f"{name}: I/O error under {self.root}{where}: {reason}") from err
        except BaseException as err:
            self._fail(name, entry, err)
            raise
        finally:
            atomic.remove(staging)

        entry.update(
            status="done",
            finished=_now(),
            seconds=round(time.perf_counter() - start, 2),
            metrics=metrics,
            outputs={out: fingerprint(self.root / out) for out in outputs},
        )
        manifest = self.manifest()
        manifest["stages"][name] = entry
        self._save(manifest)
        return entry

    def _fail(self, name: str, entry: dict[str, Any], err: BaseException) -> None:
        entry.update(
            status="failed", finished=_now(), error=str(err).splitlines()[0] if str(err) else type(err).__name__
        )
        try:
            manifest = self.manifest()
            manifest["stages"][name] = entry
            self._save(manifest)
        except OSError:
            pass  # the disk that failed the stage may refuse this too; the entry stays "running"


def is_run(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def model_dir_of(path: Path) -> Path:
    """A run directory's artifact, or the checkpoint directory itself."""
    return path / ARTIFACT if is_run(path) else path


def read_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"run_dir": str(Path(root).resolve()), "created": _now(), "stages": {}}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise OnboardError(f"{path} is unreadable: {err}") from err
