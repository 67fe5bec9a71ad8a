"""The `onboard` command line run in-process, as a user runs it, and its one-line errors."""

import sys

import pytest


def onboard(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `onboard ARGV` (through `onboard.cli.main`)."""
    from onboard.cli import main

    old = sys.argv
    sys.argv = ["onboard", *argv]
    try:
        main()
        code = 0
    except SystemExit as done:
        code = int(done.code or 0)
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(stderr: str) -> str:
    """The CLI's error: one `onboard: error:` line, last, and no traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("onboard: error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]) and "Traceback" not in stderr
    return errors[0]
