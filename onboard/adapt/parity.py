"""Engine against transformers on the same weights: teacher-forced logits and greedy text."""

from dataclasses import dataclass

import torch

from onboard.evaluate.kl import KLStats


@dataclass
class GreedyComparison:
    matched: bool
    first_divergence: int | None  # token index of the first difference
    near_tie: bool  # at that index each side's token is in the other's top-5


def compare_logits(engine_logits: torch.Tensor, reference_logits: torch.Tensor, stats: KLStats) -> float:
    """Feed one prompt's [T, V] logits into `stats` (KL of engine against reference); return the
    largest absolute logit difference."""
    targets = reference_logits.argmax(-1)  # perplexity is not the point here; any target works
    stats.update(reference_logits, engine_logits, targets)
    return float((engine_logits.float() - reference_logits.float()).abs().max())


def compare_greedy(
    engine_tokens: list[int],
    reference_tokens: list[int],
    engine_top: list[list[int]],
    reference_top: list[list[int]],
) -> GreedyComparison:
    """Token-by-token comparison; `*_top[i]` are the top-5 token ids of each side at step i.

    A divergence is a near-tie when each side's chosen token is among the other's top-5 log
    probabilities there, the rule vLLM's own model tests use (`check_logprobs_close`)."""
    length = min(len(engine_tokens), len(reference_tokens))
    for i in range(length):
        if engine_tokens[i] != reference_tokens[i]:
            tie = engine_tokens[i] in reference_top[i] and reference_tokens[i] in engine_top[i]
            return GreedyComparison(False, i, tie)
    if len(engine_tokens) != len(reference_tokens):  # one side stopped (EOS) earlier
        i = length
        mine = engine_tokens[i] if i < len(engine_tokens) else None
        theirs = reference_tokens[i] if i < len(reference_tokens) else None
        tie = (mine is None or (i < len(reference_top) and mine in reference_top[i])) and (
            theirs is None or (i < len(engine_top) and theirs in engine_top[i])
        )
        return GreedyComparison(False, i, tie)
    return GreedyComparison(True, None, True)
