"""Turn one parsed row (a JSON value or a dataset row) into a Record.

A row is a string, or an object with chat `messages`/`turns` or one of TEXT_FIELDS, plus an
optional `traffic`. Rows whose content is empty give None, so callers can skip them; rows
with no usable shape raise ValueError with the reason, for the caller to place.
"""

from collections.abc import Mapping
from typing import Any

from onboard.data.failure import FIELD_HINT
from onboard.data.record import Message, Record

TEXT_FIELDS = ("text", "prompt", "question", "instruction", "Instruction")
# Alpaca-style rows split the task in two: the instruction, then its input.
INSTRUCTION_FIELDS = ("instruction", "Instruction")
INPUT_FIELDS = ("input", "Input")


def record_from_row(row: Any, *, source: str, traffic: str = "text") -> Record | None:
    if isinstance(row, str):
        return Record(traffic=traffic, source=source, text=row) if row.strip() else None
    if not isinstance(row, Mapping):
        raise ValueError(f"expected a string or an object, got {_kind(row)}")
    traffic = _traffic(row, traffic)
    for field in ("messages", "turns"):
        if row.get(field) is not None:
            messages = _messages(row[field], field)
            return Record(traffic=traffic, source=source, messages=messages) if messages else None
    for field in TEXT_FIELDS:
        if field in row:
            text = _text(row, field)
            return Record(traffic=traffic, source=source, text=text) if text.strip() else None
    raise ValueError(f"no usable text: {FIELD_HINT}")


def _traffic(row: Mapping[str, Any], default: str) -> str:
    value = row.get("traffic")
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise ValueError(f"field 'traffic' must be a string, got {_kind(value)}")
    return value


def _text(row: Mapping[str, Any], field: str) -> str:
    text = _string(row[field], field)
    if field in INSTRUCTION_FIELDS:
        extra = next((_string(row[f], f) for f in INPUT_FIELDS if f in row), "")
        if extra.strip():
            text = f"{text}\n\n{extra}"
    return text


def _messages(value: Any, field: str) -> tuple[Message, ...]:
    """Chat turns with empty content dropped. `turns` may also be bare strings, which
    alternate user / assistant starting with the user."""
    if not isinstance(value, list):
        raise ValueError(f"field '{field}' must be a list, got {_kind(value)}")
    messages = []
    for i, turn in enumerate(value):
        if field == "turns" and isinstance(turn, str):
            message = Message("user" if i % 2 == 0 else "assistant", turn)
        elif isinstance(turn, Mapping) and isinstance(turn.get("role"), str) and turn["role"]:
            message = Message(turn["role"], _content(turn.get("content"), field, i))
        else:
            raise ValueError(f"{field}[{i}] must be an object with a role and a content")
        if message.content.strip():
            messages.append(message)
    return tuple(messages)


def _content(value: Any, field: str, index: int) -> str:
    if value is None:  # e.g. an assistant turn that only made tool calls
        return ""
    if isinstance(value, str):
        return value
    # Multimodal-style content: a list of parts, of which we keep the text ones.
    if isinstance(value, list) and all(isinstance(part, Mapping) for part in value):
        return "\n".join(
            part["text"] for part in value if part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    raise ValueError(f"{field}[{index}].content must be a string, got {_kind(value)}")


def _string(value: Any, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"field '{field}' must be a string, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else "a value")
