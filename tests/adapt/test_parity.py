"""The parity rules of `onboard adapt`: greedy match and vLLM's near-tie criterion."""

import torch

from onboard.adapt.parity import compare_greedy, compare_logits
from onboard.evaluate.kl import KLStats


def test_identical_continuations_match() -> None:
    verdict = compare_greedy([1, 2, 3], [1, 2, 3], [[1], [2], [3]], [[1], [2], [3]])
    assert verdict.matched and verdict.first_divergence is None and verdict.near_tie


def test_divergence_at_a_near_tie_is_close() -> None:
    # step 1: engine picks 5, reference 6; each is in the other's top-5 there
    verdict = compare_greedy([1, 5, 9], [1, 6, 7], [[1, 2], [5, 6, 0], [9]], [[1, 3], [6, 5, 4], [7]])
    assert not verdict.matched
    assert verdict.first_divergence == 1
    assert verdict.near_tie


def test_divergence_outside_the_other_top5_is_not_close() -> None:
    verdict = compare_greedy([1, 5], [1, 6], [[1], [5, 6]], [[1], [6, 7, 8, 9, 10]])
    assert verdict.first_divergence == 1 and not verdict.near_tie


def test_one_side_stopping_early_is_judged_at_that_position() -> None:
    eos = 0
    near = compare_greedy([1, eos], [1, 4, eos], [[1], [eos, 4]], [[1], [4, eos], [eos]])
    assert near.first_divergence == 1 and near.near_tie
    far = compare_greedy([1], [1, 4], [[1]], [[1], [4]])  # engine stopped with no top-5 at step 1
    assert far.first_divergence == 1 and not far.near_tie


def test_compare_logits_reports_the_largest_difference() -> None:
    reference = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    engine = reference.clone()
    engine[1, 0] += 0.25
    stats = KLStats()
    assert compare_logits(engine, reference, stats) == 0.25
    summary = stats.summary()
    assert summary["top1_agreement"] == 1.0 and summary["mean_kld"] > 0
