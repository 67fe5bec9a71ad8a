"""The built-in traffic sets: split rule, interleaving, filters, stdlib code, errors."""

import json
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

from onboard.data import (
    TRAFFIC_TYPES,
    Record,
    builtin_records,
    split_of,
    stdlib_code_records,
)
from onboard.errors import OnboardError
from onboard.paths import CALIBRATION_DIR

ROWS_PER_TYPE = 24


def make_row(traffic: str, i: int) -> dict[str, object]:
    row_id = f"{traffic}-{i:03d}"
    if traffic == "chat":
        return {"traffic": traffic, "id": row_id, "messages": [{"role": "user", "content": row_id}]}
    return {"traffic": traffic, "id": row_id, "prompt": f"{traffic} prompt {i}"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for traffic in TRAFFIC_TYPES:
        rows = [make_row(traffic, i) for i in range(ROWS_PER_TYPE)]
        (tmp_path / f"{traffic}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return tmp_path


def test_split_rule() -> None:
    assert split_of("x") == split_of("x")
    keys = [f"row-{i}" for i in range(4000)]
    held_out = sum(split_of(k) == "eval" for k in keys)
    assert 800 < held_out < 1200  # about one in four


def test_splits_are_disjoint_and_cover_everything(root: Path) -> None:
    calib = builtin_records("calib", root=root, stdlib_files=8)
    evaluation = builtin_records("eval", root=root, stdlib_files=8)
    calib_uids = {r.uid for r in calib}
    eval_uids = {r.uid for r in evaluation}
    assert not calib_uids & eval_uids
    own = [r for r in calib + evaluation if not r.source.startswith("stdlib:")]
    assert len(own) == len(TRAFFIC_TYPES) * ROWS_PER_TYPE
    for record in evaluation:
        if not record.source.startswith("stdlib:"):
            assert record.text is not None or record.messages is not None


def test_split_follows_row_ids(root: Path) -> None:
    for split in ("calib", "eval"):
        for record in builtin_records(split, ["math"], root=root):
            line = int(record.source.rsplit(":", 1)[1])
            assert split_of(f"math-{line - 1:03d}") == split


def test_round_robin_interleave(root: Path) -> None:
    records = builtin_records("calib", root=root, stdlib_files=4)
    assert [r.traffic for r in records[: len(TRAFFIC_TYPES)]] == list(TRAFFIC_TYPES)
    counts = Counter(r.traffic for r in records)
    assert set(counts) == set(TRAFFIC_TYPES)
    # within a type, file order is kept
    math = [r.source for r in records if r.traffic == "math"]
    assert math == sorted(math, key=lambda s: int(s.rsplit(":", 1)[1]))


def test_traffic_filter_and_determinism(root: Path) -> None:
    both = builtin_records("eval", ["math", "chat"], root=root)
    assert both == builtin_records("eval", ("chat", "math"), root=root)
    assert {r.traffic for r in both} == {"chat", "math"}
    assert both[0].traffic == "chat" and both[1].traffic == "math"
    assert {r.traffic for r in builtin_records("eval", "math", root=root)} == {"math"}


def test_code_adds_stdlib_files(root: Path) -> None:
    code = builtin_records("calib", ["code"], root=root, stdlib_files=5)
    stdlib = [r for r in code if r.source.startswith("stdlib:")]
    assert len(stdlib) == 5
    assert code[-5:] == stdlib


def test_stdlib_code_records() -> None:
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    calib = stdlib_code_records("calib", 1000)
    evaluation = stdlib_code_records("eval", 1000)
    assert calib and evaluation
    assert not {r.uid for r in calib} & {r.uid for r in evaluation}
    for split, records in (("calib", calib), ("eval", evaluation)):
        names = [r.source.removeprefix("stdlib:") for r in records]
        assert names == sorted(names)
        for name, record in zip(names, records, strict=True):
            assert record.traffic == "code"
            assert split_of(name) == split
            assert not name.startswith("test")
            assert 1024 <= (stdlib_dir / name).stat().st_size <= 40 * 1024
    assert stdlib_code_records("calib", 3) == calib[:3]


def test_unknown_traffic(root: Path) -> None:
    with pytest.raises(OnboardError) as info:
        builtin_records("calib", ["chat", "poetry"], root=root)
    message = str(info.value)
    assert "'poetry'" in message and "chat, code, math, summarization, structured" in message


def test_no_files(tmp_path: Path) -> None:
    with pytest.raises(OnboardError, match="no built-in traffic files"):
        builtin_records("calib", root=tmp_path)


def test_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    path.write_text('{"prompt": "no id"}\n', encoding="utf-8")
    with pytest.raises(OnboardError, match=r"math.jsonl:1: a built-in row needs an 'id'"):
        builtin_records("calib", root=tmp_path)
    path.write_text('{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n', encoding="utf-8")
    with pytest.raises(OnboardError, match=r"math.jsonl:2: id '1' repeats"):
        builtin_records("calib", root=tmp_path)
    path.write_text('{"id": 1, "prompt": "a", "traffic": "poetry"}\n', encoding="utf-8")
    with pytest.raises(OnboardError, match="unknown traffic type 'poetry'"):
        builtin_records("calib", root=tmp_path)


def test_missing_traffic_in_split(tmp_path: Path) -> None:
    # a row without a traffic field takes its file's name
    (tmp_path / "math.jsonl").write_text('{"id": "m", "prompt": "1+1"}\n', encoding="utf-8")
    (record,) = builtin_records(split_of("m"), ["math"], root=tmp_path)
    assert record == Record(traffic="math", source="math.jsonl:1", text="1+1")
    with pytest.raises(OnboardError, match="no built-in 'chat' records"):
        builtin_records("calib", ["chat"], root=tmp_path)


@pytest.mark.skipif(not any(CALIBRATION_DIR.glob("*.jsonl")), reason="calibration_data/ not written yet")
def test_shipped_calibration_data() -> None:
    calib = builtin_records("calib")
    evaluation = builtin_records("eval")
    assert not {r.uid for r in calib} & {r.uid for r in evaluation}
    assert {r.traffic for r in calib} == set(TRAFFIC_TYPES)
    assert {r.traffic for r in evaluation} == set(TRAFFIC_TYPES)
