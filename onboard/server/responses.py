"""Engine outputs as OpenAI response bodies: completions, chat completions, their stream chunks,
logprobs and usage.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from onboard.engine.llm_engine import RequestOutput


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


class TokenText:
    """Token id -> its text, as logprobs show it (decoded on its own; cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


@dataclass
class Accumulated:
    """A whole request's output, gathered from its `RequestOutput`s."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_completion_tokens = out.num_completion_tokens
        if out.finished:
            self.finish_reason = out.finish_reason

    def usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, self.num_completion_tokens)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Responder:
    """Builds one request's response objects; `kind` is "chat" or "completion"."""

    def __init__(self, kind: str, model: str, token_text: TokenText) -> None:
        self.kind = kind
        self.model = model
        self.token_text = token_text
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0  # completions logprobs: characters of token text so far

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    # -- logprobs ---------------------------------------------------------------------------------

    def chat_logprobs(self, entries: list[dict]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries
            ]
        }

    def _token_key(self, token_id: int) -> str:
        """A token as the legacy format names it (dict keys must differ): its text, or "token_id:N" (vLLM's
        spelling) when the text is a partial UTF-8 character that other tokens decode to as well."""
        text = self.token_text(token_id)
        return f"token_id:{token_id}" if "\ufffd" in text else text

    def completion_logprobs(self, entries: list[dict]) -> dict[str, Any]:
        offsets = []
        for e in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(self.token_text(e["token"]))
        return {
            "tokens": [self._token_key(e["token"]) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{self._token_key(t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets,
        }

    def _logprobs(self, entries: list[dict], wanted: bool) -> dict[str, Any] | None:
        if not wanted:
            return None
        return self.chat_logprobs(entries) if self.kind == "chat" else self.completion_logprobs(entries)

    # -- whole responses --------------------------------------------------------------------------

    def full(self, acc: Accumulated, logprobs: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": acc.text}
        else:
            choice["text"] = acc.text
        choice["logprobs"] = self._logprobs(acc.logprobs, logprobs)
        choice["finish_reason"] = acc.finish_reason
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [choice], usage=acc.usage())

    # -- stream chunks ----------------------------------------------------------------------------

    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        extra = {"usage": None} if include_usage else {}
        return self._envelope(obj, [{"index": 0, **choice}], **extra)

    def first_chunk(self, include_usage: bool) -> dict[str, Any] | None:
        """The chat stream opens with the assistant role; completions have no such chunk."""
        if self.kind != "chat":
            return None
        return self._chunk(
            {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}, include_usage
        )

    def chunk(self, out: RequestOutput, logprobs: bool, include_usage: bool) -> dict[str, Any] | None:
        """The chunk for one engine output, or None when it carries nothing to show."""
        if not (out.new_text or out.finished or (logprobs and out.logprobs)):
            return None
        body: dict[str, Any] = {"delta": {"content": out.new_text} if out.new_text else {}}
        if self.kind != "chat":
            body = {"text": out.new_text}
        body["logprobs"] = self._logprobs(out.logprobs, logprobs)
        body["finish_reason"] = out.finish_reason if out.finished else None
        return self._chunk(body, include_usage)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))
