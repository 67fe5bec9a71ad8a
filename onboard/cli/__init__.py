"""The `onboard` command line: thin commands over the stages, the engine, the benches and the verdict.

Each group of commands is a module (`stages`, `engine`, `quant`, `release`) of plain functions;
this table registers them, in the order `onboard --help` lists them. Options the commands share,
and their checks, are in `options`.
"""

import os
import sys

import typer

from onboard import cpu_bf16
from onboard.cli.engine import adapt, bench, bench_kv, serve
from onboard.cli.quant import bench_quant
from onboard.cli.release import gate, report, smoke
from onboard.cli.stages import demo, evaluate, quantize, run, speculator
from onboard.errors import OnboardError

app = typer.Typer(
    help="Onboard a new open-weights model: quantize, evaluate, speculate, adapt, smoke-test, report, gate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

COMMANDS = {
    "quantize": quantize,
    "eval": evaluate,
    "speculator": speculator,
    "run": run,
    "adapt": adapt,
    "bench": bench,
    "serve": serve,
    "smoke": smoke,
    "report": report,
    "gate": gate,
    "bench-quant": bench_quant,
    "bench-kv": bench_kv,
    "demo": demo,
}
for name, command in COMMANDS.items():
    app.command(name)(command)


def _quiet_libraries() -> None:
    """Library chatter (warnings about CPU, offloading, long sequences) drowns our output."""
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def main() -> None:
    _quiet_libraries()
    cpu_bf16.install()
    try:
        code = app(standalone_mode=False)
    except OnboardError as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("onboard: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.TyperException as err:  # usage errors: unknown option, missing argument
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        print(f"onboard: error: {message} (see onboard --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
