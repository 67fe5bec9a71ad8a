"""From Records to the token windows a model is calibrated or evaluated on."""

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

from onboard.data.failure import data_error
from onboard.data.record import Record


def render(record: Record, tokenizer: Any, *, chat: bool, generation_prompt: bool | None = None) -> str:
    """The record as the model would see it: through the tokenizer's chat template when
    `chat` is set and the tokenizer has one (a text record becomes one user turn), else
    plain text, with a conversation's turn contents joined by blank lines. The template
    opens an assistant turn after it when `generation_prompt` is set (None: when the
    conversation ends on a user turn)."""
    if _templated(tokenizer, chat):
        if record.messages is not None:
            turns = [{"role": m.role, "content": m.content} for m in record.messages]
        else:
            turns = [{"role": "user", "content": record.text}]
        if generation_prompt is None:
            generation_prompt = turns[-1]["role"] == "user"
        try:
            rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja2 errors, including the template's raise_exception
            raise data_error(f"{record.source}: the chat template rejected it: {exc}") from None
        return str(rendered)
    if record.text is not None:
        return record.text
    return "\n\n".join(m.content for m in record.messages or ())


def encode(record: Record, tokenizer: Any, *, chat: bool, generation_prompt: bool | None = None) -> list[int]:
    """Token ids of the rendered record (see `render`). A chat template writes its own BOS
    and special tokens, so they are added only to plain text: adding them again would
    double them."""
    text = render(record, tokenizer, chat=chat, generation_prompt=generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=not _templated(tokenizer, chat)))


def tokenize_records(records: Iterable[Record], tokenizer: Any, *, chat: bool, max_length: int) -> list[list[int]]:
    """Token ids of each rendered record, cut to `max_length`; empty results are dropped.
    For documents cut into windows; prompts a model answers come from `chat_prompts`."""
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    token_lists = []
    for record in records:
        ids = encode(record, tokenizer, chat=chat)[:max_length]
        if ids:
            token_lists.append(ids)
    return token_lists


def pack_tokens(
    token_lists: Iterable[Sequence[int]],
    *,
    window: int,
    max_tokens: int,
    separator: int | None = None,
) -> list[list[int]]:
    """Documents concatenated (with `separator`, e.g. the EOS id, between them) and cut
    into windows of `window` tokens, until `max_tokens` tokens are taken. The last window
    may be shorter, but one under 2 tokens has no next-token prediction and is dropped."""
    if window < 2:
        raise ValueError(f"window must be at least 2, got {window}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    windows: list[list[int]] = []
    current: list[int] = []
    for token in islice(_stream(token_lists, separator), max_tokens):
        current.append(token)
        if len(current) == window:
            windows.append(current)
            current = []
    if len(current) >= 2:
        windows.append(current)
    return windows


def _stream(token_lists: Iterable[Sequence[int]], separator: int | None) -> Iterator[int]:
    first = True
    for tokens in token_lists:
        if not tokens:
            continue
        if not first and separator is not None:
            yield separator
        first = False
        yield from tokens


def _templated(tokenizer: Any, chat: bool) -> bool:
    return chat and bool(getattr(tokenizer, "chat_template", None))
