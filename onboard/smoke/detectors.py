"""Generation-quality detectors for the smoke stage.

Pure Python over token ids and decoded text, so they run (and are tested) without torch. The smoke stage runs the
quantized model and its unquantized reference on the same prompts and compares what these report for each.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

_ALLOWED_CONTROLS = frozenset("\n\r\t")


@dataclass(frozen=True)
class Loop:
    """A periodic suffix of a token sequence: what a model stuck repeating itself leaves behind."""

    start: int  # index of the first token of the repeating suffix
    period: int  # tokens per repetition
    span: int  # tokens the repeating suffix covers (len(tokens) - start)

    @property
    def repeats(self) -> float:
        """How many repetitions the suffix covers; fractional when max_tokens cut the last one off."""
        return self.span / self.period


def _periodic_suffix_start(tokens: Sequence[int], period: int) -> int:
    """Smallest s such that tokens[i] == tokens[i + period] for every i in [s, len(tokens) - period)."""
    for i in range(len(tokens) - period - 1, -1, -1):
        if tokens[i] != tokens[i + period]:
            return i + 1
    return 0


def find_loop(
    tokens: Sequence[int],
    min_period: int = 1,
    max_period: int = 64,
    min_repeats: int = 3,
    min_span: int = 32,
) -> Loop | None:
    """Find the longest periodic suffix with period in [min_period, max_period].

    It must cover at least min_repeats * period tokens and at least min_span tokens; a partial final repetition
    counts. Among qualifying periods the longest span wins, ties going to the smallest period (a period-2 loop is
    also periodic with period 4 and must be reported as 2). Returns None when nothing qualifies.
    """
    if min_period < 1:
        raise ValueError(f"min_period must be >= 1, got {min_period}")
    n = len(tokens)
    best: Loop | None = None
    for period in range(min_period, min(max_period, n) + 1):
        start = _periodic_suffix_start(tokens, period)
        span = n - start
        if span < min_repeats * period or span < min_span:
            continue
        # Periods are visited in increasing order, so strict > keeps the smallest period on ties.
        if best is None or span > best.span:
            best = Loop(start=start, period=period, span=span)
    return best


def _ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(outputs: Sequence[Sequence[int]], n: int = 2) -> float:
    """Corpus-level distinct-n: unique n-grams over all outputs / total n-grams.

    N-grams never cross output boundaries. Returns 0.0 when there are no n-grams at all (every output shorter
    than n), so an empty corpus reads as degenerate rather than perfectly diverse.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [g for out in outputs for g in _ngrams(out, n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _ngram_set(tokens: Sequence[int], n: int) -> frozenset[tuple[int, ...]]:
    if not tokens:
        return frozenset()
    if len(tokens) < n:
        # Short outputs are their own single "n-gram", so two identical short answers still match.
        return frozenset({tuple(tokens)})
    return frozenset(_ngrams(tokens, n))


def near_duplicates(
    outputs: Sequence[Sequence[int]], threshold: float = 0.9, n: int = 4
) -> list[tuple[int, int, float]]:
    """Pairs (i, j, similarity), i < j, whose Jaccard similarity of token n-gram sets is >= threshold.

    Each output answers a different prompt, so near-identical answers mean the model ignores its input. An empty
    output never matches anything. Sorted by similarity descending, then (i, j).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    sets = [_ngram_set(out, n) for out in outputs]
    pairs: list[tuple[int, int, float]] = []
    for i, j in combinations(range(len(sets)), 2):
        a, b = sets[i], sets[j]
        if not a or not b:
            continue
        similarity = len(a & b) / len(a | b)
        if similarity >= threshold:
            pairs.append((i, j, similarity))
    pairs.sort(key=lambda p: (-p[2], p[0], p[1]))
    return pairs


def near_duplicate_rate(outputs: Sequence[Sequence[int]], threshold: float = 0.9, n: int = 4) -> float:
    """Fraction of outputs in at least one near-duplicate pair (0.0 when there are no outputs)."""
    if not outputs:
        return 0.0
    members = {k for i, j, _ in near_duplicates(outputs, threshold, n) for k in (i, j)}
    return len(members) / len(outputs)


def garbage(text: str) -> list[str]:
    """Reasons a decoded output is garbage; empty when clean.

    U+FFFD is what a tokenizer decode gives for invalid UTF-8 byte sequences; lone surrogates fail strict encoding.
    """
    reasons: list[str] = []
    if "\ufffd" in text:
        reasons.append("replacement character")
    if any(unicodedata.category(c) == "Cc" and c not in _ALLOWED_CONTROLS for c in text):
        reasons.append("control character")
    try:
        text.encode("utf-8", "strict")
    except UnicodeEncodeError:
        reasons.append("invalid utf-8")
    return reasons


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; a length difference counts at min(len). None when identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mean_entropy(entropies: Sequence[Sequence[float]]) -> float:
    """Mean per-step entropy pooled over all steps of all outputs (0.0 when there are no steps)."""
    steps = sum(len(e) for e in entropies)
    return sum(sum(e) for e in entropies) / steps if steps else 0.0
