"""Engine outputs as OpenAI response bodies: completions, chat completions, their stream chunks,
logprobs, usage, and vLLM's extensions: `prompt_logprobs` and the legacy `echo`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from onboard.engine import RequestOutput


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
_FLOOR = -9999.0  # what OpenAI and vLLM send for a logprob of -inf (JSON has no infinity)


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR)


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
    prompt_logprobs: list[dict | None] | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
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


@dataclass
class Echo:
    """A completion's legacy `echo`: the prompt comes back before the completion, its tokens first in
    the logprobs block (the first one with logprob null). `only` (max_tokens 0): the prompt alone."""

    text: str
    token_ids: list[int]
    only: bool = False
    num_logprobs: int | None = None  # the request's `logprobs`: top entries shown per token

    def entries(self, prompt_logprobs: list[dict | None] | None) -> list[dict]:
        """The prompt tokens as legacy logprobs entries (the engine's, top cut to `num_logprobs`)."""
        scored = prompt_logprobs or [None] * len(self.token_ids)
        n = self.num_logprobs
        return [
            {"token": t, "logprob": None, "top": None}
            if e is None
            else {**e, "top": e["top"] if n is None or n == -1 else e["top"][:n]}
            for t, e in zip(self.token_ids, scored, strict=True)
        ]


class Responder:
    """Builds one request's response objects; `kind` is "chat" or "completion"."""

    def __init__(
        self,
        kind: str,
        model: str,
        token_text: TokenText,
        echo: Echo | None = None,
        prompt_token_ids: list[int] | None = None,  # shown on a completion's choice (`return_token_ids`)
    ) -> None:
        self.kind = kind
        self.prompt_token_ids = prompt_token_ids
        self.model = model
        self.token_text = token_text
        self.echo = echo
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0  # completions logprobs: characters of token text so far
        self._echoed = False  # stream: the prompt went out with the first chunk

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    # -- logprobs ---------------------------------------------------------------------------------

    def chat_logprobs(self, entries: list[dict]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

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
        """The legacy block. Each token's `top_logprobs` holds the token itself, then the top N (so N
        or N + 1 entries, as OpenAI and vLLM); an echoed first prompt token has null for both."""
        offsets = []
        for e in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(self.token_text(e["token"]))

        def top(e: dict) -> dict[str, float] | None:
            if e["top"] is None:
                return None
            return {self._token_key(t): _finite(lp) for t, lp in [(e["token"], e["logprob"]), *e["top"]]}

        return {
            "tokens": [self._token_key(e["token"]) for e in entries],
            "token_logprobs": [None if e["logprob"] is None else _finite(e["logprob"]) for e in entries],
            "top_logprobs": [top(e) for e in entries],
            "text_offset": offsets,
        }

    def prompt_logprobs(self, entries: list[dict | None] | None) -> list[dict[str, dict] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
        decoded_token}} holding the prompt token (its true rank) and then the top N (ranks 1..N)."""
        if entries is None:
            return None

        def one(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
            return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self.token_text(token_id)}

        out: list[dict[str, dict] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            position = {str(e["token"]): one(e["token"], e["logprob"], e["rank"])}
            for rank, (t, lp) in enumerate(e["top"], start=1):
                position[str(t)] = one(t, lp, rank)
            out.append(position)
        return out

    def _logprobs(self, entries: list[dict], wanted: bool) -> dict[str, Any] | None:
        if not wanted:
            return None
        return self.chat_logprobs(entries) if self.kind == "chat" else self.completion_logprobs(entries)

    # -- whole responses --------------------------------------------------------------------------

    def _echoed_output(self, text: str, entries: list[dict], prompt_logprobs: list | None) -> tuple[str, list[dict]]:
        """Text and logprobs entries with the echoed prompt in front (as they are without echo)."""
        if self.echo is None:
            return text, entries
        shown_text, shown = ("", []) if self.echo.only else (text, entries)
        return self.echo.text + shown_text, self.echo.entries(prompt_logprobs) + shown

    def full(self, acc: Accumulated, logprobs: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        prompt_logprobs = self.prompt_logprobs(acc.prompt_logprobs)
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": acc.text}
            choice["logprobs"] = self._logprobs(acc.logprobs, logprobs)
            choice["finish_reason"] = acc.finish_reason
            # vLLM puts a chat response's prompt_logprobs at the top level, a completion's on its choice.
            return self._envelope("chat.completion", [choice], usage=acc.usage(), prompt_logprobs=prompt_logprobs)
        text, entries = self._echoed_output(acc.text, acc.logprobs, acc.prompt_logprobs)
        choice["text"] = text
        choice["logprobs"] = self._logprobs(entries, logprobs)
        choice["finish_reason"] = acc.finish_reason
        choice["prompt_logprobs"] = prompt_logprobs
        if self.prompt_token_ids is not None:
            choice["prompt_token_ids"] = self.prompt_token_ids
            choice["token_ids"] = [] if self.echo is not None and self.echo.only else acc.token_ids
        # The one token an echo-only request runs for is not shown, nor counted.
        completion_tokens = 0 if self.echo is not None and self.echo.only else acc.num_completion_tokens
        return self._envelope("text_completion", [choice], usage=usage(acc.num_prompt_tokens, completion_tokens))

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
        text, entries = out.new_text, out.logprobs
        if self.echo is not None:
            if self._echoed:
                text, entries = ("", []) if self.echo.only else (text, entries)
            else:
                text, entries = self._echoed_output(text, entries, out.prompt_logprobs)
                self._echoed = True
        if not (text or out.finished or (logprobs and entries)):
            return None
        body: dict[str, Any] = {"delta": {"content": text} if text else {}}
        if self.kind != "chat":
            body = {"text": text}
        body["logprobs"] = self._logprobs(entries, logprobs)
        body["finish_reason"] = out.finish_reason if out.finished else None
        return self._chunk(body, include_usage)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        if self.echo is not None and self.echo.only:
            completion_tokens = 0  # the one token an echo-only request runs for is not shown
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))
