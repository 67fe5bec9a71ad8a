"""The additive selection: a multiple-choice knapsack over groups, exact in the budget."""

import math

import numpy as np

from onboard.errors import OnboardError
from onboard.quantize.groups import Group, effective_bits, fits

RESOLUTION = 4000  # capacity units the budget's slack is divided into


def capacity_bits(groups: list[Group], budget: float) -> int:
    """The most stored bits an assignment may take: `fits` holds below this, by construction."""
    return math.floor((budget + 0.0005) * sum(g.weights for g in groups)) - 1


def check_budget(groups: list[Group], base: str, budget: float) -> int:
    """The stored bits the budget leaves above the uniform base; an error when it is below it."""
    slack = capacity_bits(groups, budget) - sum(g.bits(base) for g in groups)
    if slack < 0:
        bits = effective_bits(groups, {g.name: base for g in groups})
        raise OnboardError(f"bits budget {budget} is below {bits:.4f}, the uniform {base} model's own bits")
    return slack


def additive_selection(
    groups: list[Group], sensitivity: dict[str, dict[str, float]], ladder: tuple[str, ...], budget: float
) -> dict[str, str]:
    """The assignment minimising the sum of per-group KLs (BF16: 0) under the budget.

    Costs are rounded up to capacity units, so the answer always fits; what the rounding leaves
    unused is for the search to spend.
    """
    base = ladder[0]
    slack = check_budget(groups, base, budget)
    unit = max(slack / RESOLUTION, 1.0)
    units = int(slack // unit)
    values = [[group_kl(sensitivity, g.name, f) for f in ladder] for g in groups]
    costs = [[math.ceil((g.bits(f) - g.bits(base)) / unit) for f in ladder] for g in groups]
    best = np.zeros(units + 1)  # least summed KL within c units of extra cost, groups so far
    choices = np.zeros((len(groups), units + 1), dtype=np.int8)
    for index, (value, cost) in enumerate(zip(values, costs, strict=True)):
        candidates = np.full((len(ladder), units + 1), np.inf)
        for option, (v, c) in enumerate(zip(value, cost, strict=True)):
            if c <= units:
                candidates[option, c:] = best[: units + 1 - c] + v
        choices[index] = candidates.argmin(0)  # first (cheapest) format on ties
        best = candidates.min(0)
    assignment, remaining = {}, units
    for index in reversed(range(len(groups))):
        option = int(choices[index, remaining])
        assignment[groups[index].name] = ladder[option]
        remaining -= costs[index][option]
    chosen = {g.name: assignment[g.name] for g in groups}
    assert fits(effective_bits(groups, chosen), budget)
    return chosen


def group_kl(sensitivity: dict[str, dict[str, float]], group: str, fmt: str) -> float:
    """The measured KL of `group` alone in `fmt` (BF16, the reference itself: none)."""
    return 0.0 if fmt == "bf16" else sensitivity[group][fmt]


def predicted_kl(sensitivity: dict[str, dict[str, float]], assignment: dict[str, str]) -> float:
    return sum(group_kl(sensitivity, g, f) for g, f in assignment.items())
