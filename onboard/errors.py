"""The one exception type that means "the user gave us something we cannot use"."""


class OnboardError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero,
    without a traceback. Anything else escaping a command is a bug and keeps its traceback."""
