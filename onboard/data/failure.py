"""Errors about data the user pointed us at."""

from pathlib import Path

from onboard.errors import OnboardError

FIELD_HINT = "expected a field named text, prompt, question, instruction or Instruction, or chat messages/turns"


def data_error(message: str) -> OnboardError:
    """An OnboardError kept to one line whatever it quotes: JSON decoder messages,
    dictionary keys and paths may all contain newlines."""
    return OnboardError(message.replace("\r", "\\r").replace("\n", "\\n"))


def unreadable(path: Path, exc: OSError) -> OnboardError:
    reason = "permission denied" if isinstance(exc, PermissionError) else exc.strerror or exc
    return data_error(f"{path}: not readable: {reason}")
