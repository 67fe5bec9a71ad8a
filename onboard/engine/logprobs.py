"""Log-probabilities of given tokens: how many a request may ask for, and each token's logprob, rank
and the top N of its position, as vLLM reports prompt logprobs.

All of it is float32 `log_softmax` of the raw model logits (vLLM's default `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def num_top(n: int, vocab_size: int) -> int:
    """How many top entries `n` asks for: -1 is the whole vocabulary."""
    return vocab_size if n == -1 else min(n, vocab_size)


def check_num_logprobs(
    name: str, n: int | None, max_logprobs: int = MAX_LOGPROBS, vocab_size: int | None = None
) -> None:
    """Raise `ValueError` (its message starting with `name`) unless `n` is None, -1 (the whole
    vocabulary) or in [0, max_logprobs]; `max_logprobs` -1 means no limit (vLLM's semantics: -1 counts
    as the vocabulary size, which must not exceed the limit either)."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < -1:
        raise ValueError(f"{name} must be an integer >= 0, or -1 for the whole vocabulary; got {n!r}")
    if max_logprobs == -1:
        return
    asked = n if n != -1 else vocab_size
    if asked is None or asked > max_logprobs:
        what = f"{n}" if n != -1 else f"-1 (the whole vocabulary{f', {vocab_size} tokens' if vocab_size else ''})"
        raise ValueError(
            f"{name}: requested {what}, which is greater than max allowed: {max_logprobs} "
            "(start the server with a larger --max-logprobs; -1 lifts the limit)"
        )


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], n: int) -> list[dict]:
    """For each row of `logits` [R, V] and its token: {"token", "logprob", "rank", "top"}.

    `rank` is 1 for the most likely token; tokens as likely as it count ahead of it (vLLM's
    `batched_count_greater_than`). `top` lists the best `n` (token, logprob), most likely first
    (`n` -1: the whole vocabulary)."""
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(token_ids)} tokens")
    if not token_ids:
        return []
    lp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(-1, ids)
    ranks = (lp >= chosen).sum(dim=-1).tolist()
    k = num_top(n, lp.shape[-1])
    top_ids: list[list[int]] = []
    top_vals: list[list[float]] = []
    if k:
        values, indices = lp.topk(k, dim=-1)
        top_ids, top_vals = indices.tolist(), values.tolist()
    return [
        {
            "token": token,
            "logprob": value,
            "rank": rank,
            "top": list(zip(top_ids[i], top_vals[i], strict=True)) if k else [],
        }
        for i, (token, value, rank) in enumerate(zip(token_ids, chosen[:, 0].tolist(), ranks, strict=True))
    ]
