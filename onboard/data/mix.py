"""A token budget shared fairly between traffic types.

Built-in data mixes short prompts (chat, math) with whole source files (code); cut naively,
the files would crowd out everything else. Each type gets an equal share of the tokens, and a
type with less text than its share leaves the rest to the others.
"""

from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

from onboard.data.record import Record
from onboard.data.render import tokenize_records


def _take(documents: list[list[int]], budget: int) -> list[list[int]]:
    taken, left = [], budget
    for document in documents:
        if left <= 0:
            break
        taken.append(document[:left])
        left -= len(taken[-1])
    return taken


def tokens_by_traffic(
    records: Sequence[Record], tokenizer: Any, *, chat: bool, max_tokens: int, max_length: int
) -> dict[str, list[list[int]]]:
    """Tokenized documents per traffic type (in first-seen order), `max_tokens` in all."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(record.traffic, []).append(record)
    documents = {t: tokenize_records(rs, tokenizer, chat=chat, max_length=max_length) for t, rs in groups.items()}
    available = {t: sum(map(len, docs)) for t, docs in documents.items()}
    budget, remaining = {}, max_tokens
    by_size = sorted(available, key=available.__getitem__)
    for index, traffic in enumerate(by_size):
        budget[traffic] = min(available[traffic], remaining // (len(by_size) - index))
        remaining -= budget[traffic]
    return {t: taken for t in groups if (taken := _take(documents[t], budget[t]))}


def interleave(groups: dict[str, list[list[int]]]) -> list[list[int]]:
    """One document of each type in turn, so every window mixes traffic."""
    return [doc for batch in zip_longest(*groups.values()) for doc in batch if doc is not None]
