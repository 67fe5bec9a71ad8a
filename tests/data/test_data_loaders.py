"""`load_records`: every DATA kind, its errors, and the Record type."""

import json
from pathlib import Path

import pytest

from onboard.data import Message, Record, load_records
from onboard.errors import OnboardError


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def assert_one_line_error(path: Path, *fragments: str) -> None:
    with pytest.raises(OnboardError) as info:
        load_records(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


# --- Record -----------------------------------------------------------------------------------


def test_record_needs_exactly_one_of_text_and_messages() -> None:
    with pytest.raises(ValueError):
        Record(traffic="text", source="x")
    with pytest.raises(ValueError):
        Record(traffic="text", source="x", text="a", messages=(Message("user", "a"),))
    with pytest.raises(ValueError):
        Record(traffic="text", source="x", messages=())


def test_record_uid_hashes_content_not_source() -> None:
    a = Record(traffic="chat", source="a.jsonl:1", text="hello")
    b = Record(traffic="code", source="b.txt", text="hello")
    as_chat = Record(traffic="chat", source="a", messages=[("user", "hello")])
    assert a.uid == b.uid
    assert len(a.uid) == 16 and int(a.uid, 16) >= 0
    assert Record(traffic="text", source="a", text="hello!").uid != a.uid
    assert as_chat.uid != a.uid
    assert as_chat.messages == (Message("user", "hello"),)
    assert hash(as_chat) == hash(Record(traffic="chat", source="a", messages=(("user", "hello"),)))


# --- .jsonl -----------------------------------------------------------------------------------


def test_jsonl_text_fields(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "rows.jsonl",
        [
            {"text": "plain"},
            {"prompt": "a prompt", "traffic": "math"},
            {"question": "why?"},
            {"instruction": "Translate.", "input": "bonjour"},
            {"Instruction": "Summarize.", "input": ""},
            "a bare string",
        ],
    )
    records = load_records(path)
    assert [r.text for r in records] == [
        "plain",
        "a prompt",
        "why?",
        "Translate.\n\nbonjour",
        "Summarize.",
        "a bare string",
    ]
    assert [r.traffic for r in records] == ["text", "math", "text", "text", "text", "text"]
    assert [r.source for r in records] == [f"rows.jsonl:{i}" for i in range(1, 7)]
    assert all(r.messages is None for r in records)


def test_jsonl_chat_messages_and_turns(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "traffic": "chat",
                "messages": [
                    {"role": "system", "content": ""},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ],
            },
            {"turns": ["q1", "a1", "q2"]},
            {"turns": [{"role": "user", "content": "x"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
        ],
    )
    first, turns, turn_dicts, parts = load_records(path)
    assert first.traffic == "chat" and first.text is None
    # the empty system turn is dropped
    assert first.messages == (Message("user", "hi"), Message("assistant", "hello"))
    assert turns.messages == (
        Message("user", "q1"),
        Message("assistant", "a1"),
        Message("user", "q2"),
    )
    assert turn_dicts.messages == (Message("user", "x"),)
    assert parts.messages == (Message("user", "parts"),)


def test_jsonl_skips_blank_lines_and_empty_content(tmp_path: Path) -> None:
    path = tmp_path / "sparse.jsonl"
    path.write_text(
        '{"text": ""}\n\n{"text": "kept"}\n   \n{"messages": [{"role": "user", "content": " "}]}\n',
        encoding="utf-8",
    )
    records = load_records(path)
    assert [(r.source, r.text) for r in records] == [("sparse.jsonl:3", "kept")]


# --- .json ------------------------------------------------------------------------------------


def test_json_list(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text(json.dumps(["one", {"prompt": "two", "traffic": "code"}, ""]), "utf-8")
    records = load_records(path)
    assert [(r.text, r.traffic, r.source) for r in records] == [
        ("one", "text", "list.json[0]"),
        ("two", "code", "list.json[1]"),
    ]


def test_json_mapping(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"b": "second", "a": "first", "empty": ""}), "utf-8")
    records = load_records(path)
    assert [(r.source, r.text) for r in records] == [("json:b", "second"), ("json:a", "first")]


# --- .txt -------------------------------------------------------------------------------------


def test_small_txt_is_one_record(tmp_path: Path) -> None:
    text = "Para one.\n\nPara two.\n"
    path = tmp_path / "notes.txt"
    path.write_text(text, encoding="utf-8")
    assert load_records(path) == [Record(traffic="text", source="notes.txt", text=text)]


def test_long_txt_is_chunked_on_blank_lines(tmp_path: Path) -> None:
    paragraphs = [f"paragraph {i} " + "word " * 300 for i in range(60)]  # ~1.5k chars each
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    records = load_records(path)
    assert len(records) > 1
    assert all(len(r.text or "") <= 20_000 for r in records)
    # chunks hold whole paragraphs, in order, and lose none
    rejoined = "\n\n".join(r.text or "" for r in records)
    assert rejoined.split("\n\n") == [p.strip() for p in paragraphs]
    assert records[0].source == "book.txt:1"
    second_start = len(records[0].text.split("\n\n"))  # paragraphs are one line each
    assert records[1].source == f"book.txt:{2 * second_start + 1}"


def test_long_single_paragraph_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "wall.txt"
    path.write_text("x" * 45_000, encoding="utf-8")
    records = load_records(path)
    assert [len(r.text or "") for r in records] == [20_000, 20_000, 5_000]


# --- directories ------------------------------------------------------------------------------


def test_directory_of_text_and_source_files(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "README.md").write_text("# Title\n", encoding="utf-8")
    (root / "pkg" / "mod.py").write_text("x = 1\n", encoding="utf-8")
    (root / "pkg" / "conf.yaml").write_text("a: 1\n", encoding="utf-8")
    (root / "a.txt").write_text("notes\n", encoding="utf-8")
    (root / "pkg" / "__pycache__" / "mod.py").write_text("cached\n", encoding="utf-8")
    (root / ".git" / "HEAD.txt").write_text("hidden\n", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG\r\n")
    (root / "blob.txt").write_bytes(b"text\x00with nul")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "blank.md").write_text("  \n", encoding="utf-8")

    records = load_records(root)
    assert [(r.source, r.traffic, r.text) for r in records] == [
        ("README.md", "text", "# Title\n"),
        ("a.txt", "text", "notes\n"),
        ("pkg/conf.yaml", "code", "a: 1\n"),
        ("pkg/mod.py", "code", "x = 1\n"),
    ]


def test_saved_dataset(tmp_path: Path) -> None:
    import datasets

    rows = {"text": ["alpha", "", "gamma"], "traffic": ["math", "math", None]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    records = load_records(tmp_path / "ds")
    assert [(r.text, r.traffic, r.source) for r in records] == [
        ("alpha", "math", "ds:0"),
        ("gamma", "text", "ds:2"),
    ]


def test_saved_dataset_dict_prefers_train(tmp_path: Path) -> None:
    import datasets

    chat = {"messages": [[{"role": "user", "content": "hi"}]]}
    splits = datasets.DatasetDict(
        {
            "test": datasets.Dataset.from_dict({"prompt": ["from test"]}),
            "train": datasets.Dataset.from_dict(chat),
        }
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    (record,) = load_records(tmp_path / "dd")
    assert record.messages == (Message("user", "hi"),)
    assert record.source == "dd[train]:0"

    datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"prompt": ["first"]}),
            "test": datasets.Dataset.from_dict({"prompt": ["second"]}),
        }
    ).save_to_disk(str(tmp_path / "no_train"))
    assert [r.text for r in load_records(tmp_path / "no_train")] == ["first"]


def test_loading_is_deterministic(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    for name in ["z.py", "b.md", "m.txt", "a.rs"]:
        (root / name).write_text(f"content of {name}\n", encoding="utf-8")
    first = load_records(root)
    assert [r.source for r in first] == ["a.rs", "b.md", "m.txt", "z.py"]
    assert load_records(str(root)) == first
    assert [r.uid for r in load_records(root)] == [r.uid for r in first]


# --- errors -----------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    assert_one_line_error(tmp_path / "nope.jsonl", "no such file or directory")


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "table.csv"
    path.write_text("a,b\n", encoding="utf-8")
    assert_one_line_error(path, "unsupported file type '.csv'", ".jsonl")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty.jsonl", ""),
        ("blank_rows.jsonl", '{"text": ""}\n{"prompt": "  "}\n'),
        ("empty_list.json", "[]"),
        ("empty_map.json", '{"k": ""}'),
    ],
)
def test_no_usable_text(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert_one_line_error(path, "contains no usable text: expected a field named text, prompt, question")


def test_empty_txt_and_directory(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    assert_one_line_error(tmp_path / "empty.txt", "contains no usable text")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "data.bin").write_bytes(b"\x00\x01")
    assert_one_line_error(tmp_path / "dir", "contains no usable text", ".py")


def test_row_without_known_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "ok"}, {"body": "what field?"}])
    assert_one_line_error(path, f"{path}:2: no usable text: expected a field named text")


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        (42, "expected a string or an object"),
        ({"text": 3}, "field 'text' must be a string"),
        ({"messages": "hi"}, "field 'messages' must be a list"),
        ({"messages": [{"content": "no role"}]}, "messages[0] must be an object"),
        ({"text": "x", "traffic": 1}, "field 'traffic' must be a string"),
    ],
)
def test_malformed_rows(tmp_path: Path, row: object, fragment: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    assert_one_line_error(path, f"{path}:1: {fragment}")


def test_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    assert_one_line_error(path, f"{path}:2: invalid JSON:")


def test_invalid_json_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[\n  "a",\n  oops\n]', encoding="utf-8")
    assert_one_line_error(path, f"{path}:3: invalid JSON:")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert_one_line_error(path, f"{path}:2: not UTF-8 text")


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "locked.jsonl", [{"text": "secret"}])
    real_open = Path.open

    def denied(self: Path, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", denied)
    assert_one_line_error(path, "not readable: permission denied")


def test_damaged_saved_dataset(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    (root / "dataset_info.json").write_text("{}", encoding="utf-8")
    (root / "state.json").write_text("not json", encoding="utf-8")
    assert_one_line_error(root, "cannot load saved dataset")


def test_error_stays_on_one_line_for_odd_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"multi\nline": 5}), encoding="utf-8")
    assert_one_line_error(path, "expected a string or an object")
