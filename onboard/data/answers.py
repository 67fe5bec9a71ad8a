"""DATA rows that carry an existing answer, each read as a conversation ending in that answer.

For teacher forcing: a model scored on text it did not write, position by position. Shapes read:
gsm8k's `question` + `answer`; alpaca's `instruction` (+ `input`) + `output`, Dolly-style
`response`; self-instruct's `instruction` + `instances[].input` / `instances[].output` (one pair per
instance); chat `messages`/`turns` whose last turn is the assistant's (that turn is the answer).
The prompt is read as `load_records` reads the row; the answer becomes the assistant turn.
"""

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from onboard.data.failure import data_error
from onboard.data.json_files import iter_jsonl_rows, json_items
from onboard.data.record import Message, Record
from onboard.data.rows import record_from_row
from onboard.data.saved_dataset import is_saved_dataset, saved_rows

ANSWER_FIELDS = ("answer", "output", "response", "Answer", "Output", "Response")
ANSWER_HINT = (
    f"expected a prompt with one of {', '.join(ANSWER_FIELDS[:3])}, instances[].output, "
    "or chat messages ending with an assistant turn"
)


def answered_records(path: str | Path) -> list[Record]:
    """Every (prompt, answer) pair of a `.jsonl` or `.json` file or a saved dataset, in order, as
    conversations whose last turn is the answer's assistant turn. Raises OnboardError when the
    input is missing, unreadable, or holds no answer."""
    path = Path(path)
    if not path.exists():
        raise data_error(f"{path}: no such file or directory")
    records: list[Record] = []
    for source, where, row in _rows(path):
        try:
            records += answered_from_row(row, source=source)
        except ValueError as exc:
            raise data_error(f"{where}: {exc}") from None
    if not records:
        raise data_error(f"{path}: no row carries an answer: {ANSWER_HINT}")
    return records


def answered_from_row(row: Any, *, source: str, traffic: str = "text") -> list[Record]:
    """The row's (prompt, answer) pairs, as conversations; none for a row without an answer."""
    if not isinstance(row, Mapping):
        return []  # a bare string is a prompt or a document, not an answered one
    if row.get("messages") is not None or row.get("turns") is not None:
        record = record_from_row(row, source=source, traffic=traffic)
        messages = record.messages if record is not None else None
        answered = messages and messages[-1].role == "assistant" and any(m.role != "assistant" for m in messages)
        return [record] if answered and record is not None else []
    if isinstance(row.get("instances"), list):
        pairs = []
        for i, instance in enumerate(row["instances"]):
            if not isinstance(instance, Mapping):
                raise ValueError(f"instances[{i}] must be an object")
            prompt_row = {k: v for k, v in row.items() if k != "instances"} | {"input": instance.get("input") or ""}
            pairs.append(_pair(prompt_row, _answer(instance), f"{source}[{i}]", traffic))
        return [p for p in pairs if p is not None]
    return [p] if (p := _pair(row, _answer(row), source, traffic)) is not None else []


def _pair(row: Mapping[str, Any], answer: str | None, source: str, traffic: str) -> Record | None:
    if answer is None:
        return None
    prompt = record_from_row(dict(row), source=source, traffic=traffic)
    if prompt is None or prompt.text is None:
        return None
    return Record(prompt.traffic, source, messages=(Message("user", prompt.text), Message("assistant", answer)))


def _answer(row: Mapping[str, Any]) -> str | None:
    for field in ANSWER_FIELDS:
        value = row.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"field '{field}' must be a string")
        return value if value.strip() else None
    return None


def _rows(path: Path) -> Iterator[tuple[str, str, Any]]:
    if path.is_dir() and is_saved_dataset(path):
        yield from saved_rows(path)
    elif path.is_file() and path.suffix.lower() == ".jsonl":
        for lineno, row in iter_jsonl_rows(path):
            yield f"{path.name}:{lineno}", f"{path}:{lineno}", row
    elif path.is_file() and path.suffix.lower() == ".json":
        yield from json_items(path)
    else:
        raise data_error(f"{path}: answers are read from a .jsonl or .json file or a saved dataset directory")
