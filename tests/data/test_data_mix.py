"""`tokens_by_traffic` shares a token budget fairly; `interleave` alternates traffic types."""

import pytest
from tiny_models import build_tokenizer

from onboard.data import Record, interleave, tokens_by_traffic


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _records(traffic: str, count: int, words: int) -> list[Record]:
    return [
        Record(traffic=traffic, source=f"{traffic}{i}", text=" ".join(["word"] * words) + f" {i}") for i in range(count)
    ]


def test_long_documents_do_not_crowd_out_short_prompts(tokenizer) -> None:
    records = _records("code", 10, 400) + _records("chat", 40, 8) + _records("math", 40, 8)
    chat_available = sum(len(tokenizer.encode(r.text)) for r in records if r.traffic == "chat")
    assert chat_available > 300  # enough for an equal share
    groups = tokens_by_traffic(records, tokenizer, chat=False, max_tokens=900, max_length=10_000)
    totals = {t: sum(map(len, docs)) for t, docs in groups.items()}
    assert list(groups) == ["code", "chat", "math"]  # first-seen order
    assert totals == {"code": 300, "chat": 300, "math": 300}


def test_a_short_type_leaves_its_share_to_the_others(tokenizer) -> None:
    records = _records("math", 1, 3) + _records("code", 10, 400)
    math_tokens = len(tokenizer.encode(records[0].text))
    groups = tokens_by_traffic(records, tokenizer, chat=False, max_tokens=1000, max_length=10_000)
    assert sum(map(len, groups["math"])) == math_tokens
    assert sum(map(len, groups["code"])) == 1000 - math_tokens


def test_interleave_alternates_types() -> None:
    groups = {"a": [[1], [2], [3]], "b": [[10]], "c": [[20], [21]]}
    assert interleave(groups) == [[1], [10], [20], [2], [21], [3]]
