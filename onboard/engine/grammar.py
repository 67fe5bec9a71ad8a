"""Structured output on xgrammar: compile a JSON schema, regex or EBNF grammar once, then track each
request's matcher and turn its state into a mask over the model's (possibly padded) vocabulary.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

GrammarKind = Literal["json_schema", "json_object", "regex", "grammar"]
_KINDS = get_args(GrammarKind)
# "json_object" means an object (OpenAI's response_format), not any JSON value: xgrammar's builtin
# JSON grammar also admits a top-level array.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ errors read "[12:00:00] /project/cpp/x.cc:94: Check failed: (...) is false: msg".
_XGR_NOISE = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    spec: str = ""  # JSON schema as JSON text, regex, or EBNF; unused for "json_object"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(_KINDS)}")


class RequestGrammar:
    """One request's grammar state. Feed it every generated token with `accept`."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._bit = torch.arange(32, dtype=torch.int32)

    def _fill(self) -> bool:
        """Fill the bitmask; False once terminated (xgrammar refuses to build a mask after the stop token)."""
        if self._matcher.is_terminated():
            return False
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return True

    def _stop_only(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[[t for t in self._matcher.stop_token_ids if t < self.vocab_size]] = True
        return mask

    def allowed_mask(self, vocab_size: int | None = None) -> torch.Tensor:
        """Bool [vocab_size]: True for tokens the grammar allows next (only stop tokens once terminated).

        `vocab_size` defaults to the factory's; rows beyond the grammar's vocabulary are never allowed.
        """
        if self._fill():
            bits = (self._bitmask[0, :, None] >> self._bit) & 1
            mask = bits.flatten()[: self.vocab_size].bool()
        else:
            mask = self._stop_only()
        size = vocab_size or self.vocab_size
        if size > self.vocab_size:
            mask = torch.cat([mask, torch.zeros(size - self.vocab_size, dtype=torch.bool)])
        return mask[:size]

    def apply(self, logits: torch.Tensor) -> None:
        """Set disallowed entries of a logits row to -inf, in place (columns past `vocab_size` too)."""
        logits[self.vocab_size :] = float("-inf")
        if not self._fill():
            stop = self._stop_only().to(logits.device)
            logits[: self.vocab_size].masked_fill_(~stop, float("-inf"))
            return
        bitmask = self._bitmask[0].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return False
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted after a complete match."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    @property
    def stop_token_ids(self) -> list[int]:
        return self._matcher.stop_token_ids


class GrammarFactory:
    """Compiles grammars for one tokenizer / model vocabulary and caches them by (kind, spec).

    `vocab_size` is the model's (lm_head rows), which may exceed `len(tokenizer)`; the extra rows
    are never allowed. `stop_token_ids` defaults to the tokenizer's EOS; pass every EOS id of the
    generation config. `any_whitespace` allows free whitespace in JSON (vLLM's default).

    Known xgrammar bug (mlc-ai/xgrammar#800, open as of 0.2.9): a JSON-schema string with
    minLength/maxLength admits raw control characters and no escapes, so such output can fail a
    strict `json.loads`; strings bounded by `pattern` are unaffected.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int | None = None,
        *,
        stop_token_ids: list[int] | None = None,
        any_whitespace: bool = True,
        max_cached: int = 256,
    ) -> None:
        self.vocab_size = vocab_size or len(tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info)
        self._any_whitespace = any_whitespace
        self._max_cached = max_cached
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`; `ValueError` (one line) when it is invalid."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        return RequestGrammar(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                json.loads(spec.spec)  # a clearer message than xgrammar's for malformed JSON
                return c.compile_json_schema(spec.spec, any_whitespace=self._any_whitespace)
            if spec.kind == "json_object":
                return c.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=self._any_whitespace)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            return c.compile_grammar(spec.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid json_schema: not valid JSON: {e}") from None
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {spec.kind}: {_one_line(str(e))}") from None


def _one_line(message: str) -> str:
    first = next((line for line in message.strip().splitlines() if line.strip()), "unknown error")
    return _XGR_NOISE.sub("", first.strip()) or "unknown error"
