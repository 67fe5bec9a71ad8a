"""A server's next-token log-probabilities at every position of a prompt, as vLLM serves them.

The request is a completion of the prompt's token ids with `prompt_logprobs: k` (vLLM's extension,
also spoken by `onboard serve`): for each position after the first the server returns the top-k
tokens and the prompt's own token, each with its log-probability and rank. `k = -1` asks for the
whole vocabulary (vLLM needs `--max-logprobs -1` for that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onboard.endpoint.client import Endpoint, EndpointError

FULL_VOCAB = -1


@dataclass(frozen=True)
class PromptScores:
    """Per predicted position p (predicting prompt token p + 1): the tokens the server returned and
    their log-probabilities ([positions, m], padded with -1 / -inf), and the prompt token's own."""

    token_ids: np.ndarray  # int64 [T - 1, m]
    logprobs: np.ndarray  # float64 [T - 1, m]
    target_logprobs: np.ndarray  # float64 [T - 1]

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {"token_ids": self.token_ids, "logprobs": self.logprobs, "target_logprobs": self.target_logprobs}


def score_body(token_ids: list[int], k: int) -> dict[str, Any]:
    # max_tokens 1: some servers refuse 0 without echo; the one generated token is not used.
    return {"prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k}


def score_prompt(endpoint: Endpoint, token_ids: list[int], k: int) -> PromptScores:
    """The server's log-probabilities over `token_ids` (at least 2 tokens)."""
    try:
        response = endpoint.post("/v1/completions", score_body(token_ids, k))
    except EndpointError as err:
        if "logprob" in str(err).lower():
            wanted = "-1" if k == FULL_VOCAB else str(k)
            raise EndpointError(
                f"{err} (vLLM serves at most --max-logprobs log-probabilities, 20 by default: restart it with "
                f"--max-logprobs {wanted}, or ask for fewer with --top-logprobs)"
            ) from None
        raise
    return parse_scores(response, token_ids, f"{endpoint.spec.base}/v1/completions")


def parse_scores(response: dict[str, Any], token_ids: list[int], where: str) -> PromptScores:
    choices = response.get("choices") or [{}]
    entries = choices[0].get("prompt_logprobs", response.get("prompt_logprobs"))
    if entries is None:
        raise EndpointError(
            f"{where} returned no prompt_logprobs: the server does not serve prompt log-probabilities "
            "(vLLM's `prompt_logprobs` request field; vLLM and `onboard serve` have it, OpenAI's API does not)"
        )
    if len(entries) != len(token_ids):
        raise EndpointError(f"{where} returned {len(entries)} prompt log-probabilities for {len(token_ids)} tokens")
    width = max((len(e) for e in entries[1:] if e), default=0)
    ids = np.full((len(token_ids) - 1, width), -1, dtype=np.int64)
    logprobs = np.full((len(token_ids) - 1, width), -np.inf, dtype=np.float64)
    targets = np.empty(len(token_ids) - 1, dtype=np.float64)
    for row, (entry, target) in enumerate(zip(entries[1:], token_ids[1:], strict=True)):
        if not entry or str(target) not in entry:
            raise EndpointError(f"{where}: position {row + 1} lacks the prompt token's own log-probability")
        for col, (token, item) in enumerate(entry.items()):
            ids[row, col] = int(token)
            logprobs[row, col] = float(item["logprob"]) if isinstance(item, dict) else float(item)
        targets[row] = logprobs[row, list(entry).index(str(target))]
    return PromptScores(ids, logprobs, targets)
