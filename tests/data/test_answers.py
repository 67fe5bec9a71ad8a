"""`answered_records`: DATA rows that carry an answer, read as conversations ending in it."""

import json
from pathlib import Path

import pytest

from onboard.data import Message
from onboard.data.answers import answered_records
from onboard.errors import OnboardError


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def pairs(records) -> list[tuple[str, ...]]:
    return [tuple(m.content for m in r.messages) for r in records]


def test_every_answer_shape_gives_a_prompt_answer_pair(tmp_path: Path) -> None:
    rows = [
        {"question": "2 + 3?", "answer": "5"},  # gsm8k
        {"instruction": "Reverse it.", "input": "abc", "output": "cba"},  # alpaca
        {"instruction": "Name a colour.", "context": "", "response": "Blue.", "traffic": "chat"},  # dolly
        {  # self-instruct: one pair per instance
            "instruction": "Antonym?",
            "instances": [{"input": "hot", "output": "cold"}, {"input": "", "output": "none"}],
        },
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
        {"turns": ["Q1", "A1", "Q2", "A2"]},
        {"prompt": "no answer here"},  # skipped
        "a bare string",  # skipped
        {"messages": [{"role": "user", "content": "unanswered"}]},  # skipped
        {"question": "empty answer", "answer": "  "},  # skipped
    ]
    records = answered_records(write_jsonl(tmp_path / "a.jsonl", rows))
    assert pairs(records) == [
        ("2 + 3?", "5"),
        ("Reverse it.\n\nabc", "cba"),
        ("Name a colour.", "Blue."),
        ("Antonym?\n\nhot", "cold"),
        ("Antonym?", "none"),
        ("Hi", "Hello!"),
        ("Q1", "A1", "Q2", "A2"),
    ]
    assert all(r.messages[-1].role == "assistant" for r in records)
    assert records[0].messages == (Message("user", "2 + 3?"), Message("assistant", "5"))
    assert [r.traffic for r in records[:3]] == ["text", "text", "chat"]
    assert [r.source for r in records[3:5]] == ["a.jsonl:4[0]", "a.jsonl:4[1]"]


def test_json_lists_and_mappings(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"x": {"question": "q", "answer": "a"}, "y": "just a prompt"}))
    assert pairs(answered_records(path)) == [("q", "a")]


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("none.jsonl", '{"prompt": "p"}\n', "no row carries an answer"),
        ("bad.jsonl", '{"question": "q", "answer": 5}\n', "bad.jsonl:1: field 'answer' must be a string"),
        ("odd.jsonl", '{"answer": "a"}\n', "odd.jsonl:1: no usable text"),
        ("text.txt", "plain text\n", "answers are read from"),
    ],
)
def test_bad_inputs_are_one_line_errors(tmp_path: Path, name: str, content: str, fragment: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(OnboardError) as info:
        answered_records(path)
    assert "\n" not in str(info.value) and fragment in str(info.value)
    with pytest.raises(OnboardError, match="no such file"):
        answered_records(tmp_path / "absent.jsonl")
