"""A request as the engine tracks it: its tokens, its place in the KV cache, its state."""

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count
from typing import Any

_ids = count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """Prompt and completion tokens of one request.

    `num_computed_tokens` counts tokens whose KV is in the cache (prefix-cache hits included);
    the scheduler advances it chunk by chunk during prefill and by one per decode step.
    `block_table` lists the cache blocks holding tokens [i*block_size, (i+1)*block_size).
    """

    token_ids: list[int]
    block_size: int
    sampling: Any = None  # onboard.engine.sampler.SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its per-sequence state's slot (state_cache.py), where the model has one
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def scores_prompt(self) -> bool:
        """Its request asked for prompt logprobs: every prompt position needs its logits."""
        return getattr(self.sampling, "prompt_logprobs", None) is not None

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
