"""`write_report(run_dir)`: gather a run directory into one context and render `report.html`.

The page is one self-contained file: inline CSS, inline SVG charts, no script, no external URL.
Every string that came from a JSON file goes through Jinja's autoescaping; the only pre-built
markup is the SVG from `svg.py`, which escapes its own text. Rendering is deterministic (no clock:
the times shown are the manifest's), so rewriting an unchanged run gives a byte-identical file.
"""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2

from onboard.errors import OnboardError
from onboard.report import fmt, quality, quantize, runinfo, smoke, speculator, verdict
from onboard.report.load import Run
from onboard.workspace import REPORT

REPORT_NAME = REPORT
TEMPLATES = Path(__file__).parent / "templates"


def build_context(run_dir: Path) -> dict[str, Any]:
    run = Run(run_dir)
    context = {
        "header": runinfo.header(run),
        "verdict": verdict.build(run),
        "quantize": quantize.build(run),
        "eval": quality.build_eval(run),
        "speculator": speculator.build(run),
        "parity": quality.build_parity(run),
        "smoke": smoke.build(run),
        "bench": runinfo.bench(run),
        "stages": runinfo.stages(run),
        "versions": runinfo.versions(run),
    }
    context["problems"] = list(run.problems)  # after every card has read its files
    return context


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    for name in ("num", "pct", "pp", "mb", "secs", "label", "when"):
        env.filters[name] = _defined(getattr(fmt, name))
    env.tests["number"] = fmt.is_num
    return env


def _defined(filter_: Callable[..., str]) -> Callable[..., str]:
    """A missing key reaches a filter as Jinja's Undefined; format it like a JSON null."""

    def wrapped(value: Any, *args: Any) -> str:
        return filter_(None if isinstance(value, jinja2.Undefined) else value, *args)

    return wrapped


def render(context: dict[str, Any]) -> str:
    return environment().get_template("report.html.j2").render(**context)


def write_report(run_dir: Path) -> Path:
    """Render `run_dir/report.html` and return its path. The file is replaced atomically: a reader
    sees the previous report or the new one, never half of one."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OnboardError(f"run directory not found: {run_dir}")
    html = render(build_context(run_dir))
    target = run_dir / REPORT_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{REPORT_NAME}.", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(html)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
