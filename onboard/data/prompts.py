"""Prompts a model answers: records rendered through the chat template with the generation
prompt, as token ids, with an explicit policy for the ones over the token budget.

The one builder for everything that sends prompts to a model (bench, smoke, the speculator's
training data and measurement, adapt's parity), in-process or to an endpoint that takes token
ids: each prompt keeps its traffic type and the text a reviewer reads.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from onboard.data.failure import data_error
from onboard.data.record import Record
from onboard.data.render import encode

Fit = Literal["skip", "truncate", "error"]
FIT_POLICIES: tuple[str, ...] = get_args(Fit)


@dataclass(frozen=True)
class ChatPrompt:
    """One prompt as the model receives it."""

    token_ids: list[int]  # the whole templated prompt, the opened assistant turn included
    traffic: str  # the kind of request it stands for (the record's traffic type)
    text: str  # what a reviewer reads: the record's text, or its last user turn
    source: str  # where the record came from, e.g. "file.jsonl:12"


def chat_prompts(
    records: Iterable[Record],
    tokenizer: Any,
    *,
    max_tokens: int,
    fit: Fit = "skip",
    limit: int | None = None,
) -> list[ChatPrompt]:
    """The records as prompts, in order, until `limit` are built (all when None; none when 0).

    Each is rendered through the tokenizer's chat template (plain text without one) with the
    assistant turn opened; a conversation ending in assistant turns is prompted up to them, the
    model being asked to write them. A prompt over `max_tokens` tokens is, by `fit`: "skip"
    dropped, "truncate" cut to its last `max_tokens` tokens, "error" a one-line OnboardError
    naming the record. Records that give no prompt (only assistant turns, no tokens) are
    dropped; none left at all is an OnboardError.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if fit not in FIT_POLICIES:
        raise ValueError(f"fit must be one of {', '.join(FIT_POLICIES)}, got {fit!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must not be negative, got {limit}")
    if limit == 0:
        return []
    prompts: list[ChatPrompt] = []
    seen = too_long = 0
    for record in records:
        if limit is not None and len(prompts) == limit:
            break
        seen += 1
        request = _request(record)
        if request is None:
            continue
        ids = encode(request, tokenizer, chat=True, generation_prompt=True)
        if not ids:
            continue
        if len(ids) > max_tokens:
            if fit == "error":
                raise data_error(f"{record.source}: the prompt is {len(ids)} tokens, over the limit of {max_tokens}")
            if fit == "skip":
                too_long += 1
                continue
            # The tail, as vLLM's truncate_prompt_tokens, TGI's truncate and lm-evaluation-harness
            # keep: the model answers the end of a prompt (the last user turn and the assistant
            # header), so its head (BOS, system prompt, earlier turns) is what can be spared.
            ids = ids[-max_tokens:]
        prompts.append(ChatPrompt(ids, record.traffic, _shown(request), record.source))
    if not prompts:
        over = f", {too_long} of them over {max_tokens} tokens" if too_long else ""
        raise data_error(f"no usable prompt in {seen} records{over}")
    return prompts


def _request(record: Record) -> Record | None:
    """The record as a request: a text as it is, a conversation without its trailing assistant
    turns (None when nothing else is left)."""
    if record.messages is None or record.messages[-1].role != "assistant":
        return record
    messages = list(record.messages)
    while messages and messages[-1].role == "assistant":
        messages.pop()
    if not messages:
        return None
    return Record(traffic=record.traffic, source=record.source, messages=tuple(messages))


def _shown(request: Record) -> str:
    if request.text is not None:
        return request.text
    messages = request.messages or ()
    return next((m.content for m in reversed(messages) if m.role == "user"), messages[-1].content)
