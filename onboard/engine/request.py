"""What the engine keeps per request and what it hands back: step outputs and whole completions."""

from dataclasses import dataclass, field

import torch

from onboard.engine.grammar import RequestGrammar
from onboard.engine.sampler import SamplingParams
from onboard.engine.sequence import Sequence


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text, and whether it ended."""

    request_id: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    logprobs: list[dict] = field(default_factory=list)  # per new token: {"token", "logprob", "top"}
    # With `SamplingParams.prompt_logprobs`, on the request's first output only: per prompt position
    # None (the first) or {"token", "logprob", "rank", "top"} (`onboard.engine.logprobs`).
    prompt_logprobs: list[dict | None] | None = None


@dataclass
class EngineRequest:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    grammar: RequestGrammar | None
    text: str = ""
    emitted: int = 0  # characters of `text` already returned
    logprobs: list[dict] = field(default_factory=list)
    # Prompt positions scored so far while prefilling; None when not asked for or already returned.
    prompt_logprobs: list[dict | None] | None = None


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict]
    prompt_logprobs: list[dict | None] | None = None
