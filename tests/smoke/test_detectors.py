import random

import pytest

from onboard.smoke.detectors import (
    Loop,
    distinct_n,
    find_loop,
    first_divergence,
    garbage,
    mean_entropy,
    near_duplicate_rate,
    near_duplicates,
)

PREFIX = [900, 901, 902, 903, 904, 905, 906, 907, 908, 909]


def _is_primitive(pattern: list[int]) -> bool:
    p = len(pattern)
    return all(pattern != pattern[:d] * (p // d) for d in range(1, p) if p % d == 0)


@pytest.mark.parametrize(
    ("pattern", "times"),
    [([5], 40), ([1, 2], 20), ([1, 2, 3, 4, 5, 6, 7], 6), (list(range(100, 164)), 3)],
)
def test_loop_found_with_period_start_and_span(pattern, times):
    tokens = PREFIX + pattern * times
    loop = find_loop(tokens)
    assert loop == Loop(start=len(PREFIX), period=len(pattern), span=len(pattern) * times)
    assert loop.repeats == times


def test_loop_without_prefix_starts_at_zero():
    assert find_loop([3, 4, 5] * 20) == Loop(start=0, period=3, span=60)


def test_partial_final_repetition_counts():
    tokens = PREFIX + [1, 2, 3, 4, 5, 6, 7] * 5 + [1, 2, 3]
    loop = find_loop(tokens)
    assert loop == Loop(start=len(PREFIX), period=7, span=38)
    assert loop.repeats == pytest.approx(38 / 7)


def test_prefix_sharing_the_pattern_tail_extends_start_back():
    # The prefix ends in the pattern's last two tokens, so the periodic suffix really does start two tokens earlier.
    tokens = [*PREFIX, 6, 7, *([1, 2, 3, 4, 5, 6, 7] * 6)]
    assert find_loop(tokens) == Loop(start=len(PREFIX), period=7, span=44)


def test_loop_shorter_than_min_span_not_flagged():
    tokens = PREFIX + [1, 2] * 10  # 20 tokens < 32
    assert find_loop(tokens) is None
    assert find_loop(tokens, min_span=20) == Loop(start=len(PREFIX), period=2, span=20)


def test_too_few_repeats_not_flagged():
    pattern = list(range(200, 220))
    tokens = PREFIX + pattern * 2 + pattern[:10]  # 2.5 repetitions, 50 tokens >= min_span
    assert find_loop(tokens) is None
    assert find_loop(tokens, min_repeats=2) == Loop(start=len(PREFIX), period=20, span=50)


def test_period_above_max_period_not_flagged():
    tokens = PREFIX + list(range(300, 380)) * 4
    assert find_loop(tokens) is None
    assert find_loop(tokens, max_period=80) == Loop(start=len(PREFIX), period=80, span=320)


def test_ties_go_to_smallest_period():
    tokens = PREFIX + [1, 2] * 40  # also periodic with 4, 6, ..., 64 over the same span
    assert find_loop(tokens) == Loop(start=len(PREFIX), period=2, span=80)
    assert find_loop(tokens, min_period=3).period == 4


def test_numbered_list_with_changing_number_not_flagged():
    # "1. the same item\n2. the same item\n..." where only the number token changes.
    tokens = [t for k in range(1, 21) for t in (100 + k, 7, 11, 12, 13, 10)]
    assert find_loop(tokens) is None


def test_one_token_changed_in_each_repetition_not_flagged():
    tokens = [t for k in range(30) for t in (1, 2, 3, 500 + k, 5, 6)]
    assert find_loop(tokens) is None


def test_list_items_sharing_words_not_flagged():
    # "the best way to <verb> <noun> is to <verb> it carefully ." with varying verbs and nouns.
    items = [(21, 22, 23, 24, 30 + k, 60 + (k * 7) % 13, 25, 24, 40 + (k * 3) % 11, 26, 27, 28) for k in range(12)]
    tokens = [t for item in items for t in item]
    assert find_loop(tokens) is None


def test_repeated_phrase_separated_by_varied_text_not_flagged():
    rng = random.Random(1)
    tokens: list[int] = []
    for _ in range(10):
        tokens += [1, 2, 3, 4, 5]
        tokens += [rng.randrange(1000, 2000) for _ in range(rng.randint(3, 10))]
    assert find_loop(tokens) is None


@pytest.mark.parametrize("tokens", [[], [1], [1, 2, 3]])
def test_short_or_empty_not_flagged(tokens):
    assert find_loop(tokens) is None


def test_min_period_must_be_positive():
    with pytest.raises(ValueError):
        find_loop([1] * 40, min_period=0)


def test_random_primitive_loops_always_found_with_their_period():
    rng = random.Random(0)
    checked = 0
    while checked < 300:
        p = rng.randint(1, 64)
        pattern = [rng.randrange(8) for _ in range(p)]  # small alphabet so non-primitive patterns do occur
        if not _is_primitive(pattern):
            continue
        prefix = [rng.randrange(8) for _ in range(rng.randint(0, 50))]
        if prefix and prefix[-1] == pattern[-1]:
            prefix[-1] = (pattern[-1] + 1) % 8  # so the periodic suffix starts exactly after the prefix
        # At least 64 + p tokens: any other period q <= 64 over that span would force period gcd(p, q) (Fine-Wilf).
        times = max(3, -(-(64 + p) // p))
        tail = pattern[: rng.randint(0, p - 1)]
        loop = find_loop(prefix + pattern * times + tail)
        assert loop == Loop(start=len(prefix), period=p, span=p * times + len(tail))
        checked += 1


def test_random_sequences_not_flagged():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(32000) for _ in range(rng.randint(0, 512))]
        assert find_loop(tokens) is None


@pytest.mark.parametrize(
    ("outputs", "n", "expected"),
    [
        ([[1, 2, 3], [1, 2, 4]], 2, 3 / 4),
        ([[1, 2], [1, 2]], 2, 1 / 2),  # crossing the boundary would add (2, 1) and give 2/3
        ([[1, 1, 2]], 1, 2 / 3),
        ([[1, 2, 3, 4]], 2, 1.0),
        ([[7, 7, 7, 7, 7]], 2, 1 / 4),
        ([[1], [2]], 2, 0.0),
        ([], 2, 0.0),
    ],
)
def test_distinct_n(outputs, n, expected):
    assert distinct_n(outputs, n) == pytest.approx(expected)


def test_near_duplicates_finds_identical_outputs_for_different_prompts():
    a = list(range(20))
    b = list(range(100, 120))
    c = list(range(200, 220))
    assert near_duplicates([a, b, list(a), c]) == [(0, 2, 1.0)]
    assert near_duplicate_rate([a, b, list(a), c]) == 0.5


def test_near_duplicates_ignores_different_outputs():
    rng = random.Random(0)
    outputs = [[rng.randrange(32000) for _ in range(50)] for _ in range(10)]
    assert near_duplicates(outputs) == []
    assert near_duplicate_rate(outputs) == 0.0


def test_near_duplicates_threshold_is_inclusive():
    outputs = [[1, 2, 3], [2, 3, 4]]  # unigram sets share 2 of 4: Jaccard 0.5
    assert near_duplicates(outputs, threshold=0.5, n=1) == [(0, 1, 0.5)]
    assert near_duplicates(outputs, threshold=0.51, n=1) == []


def test_near_duplicates_sorted_by_similarity_then_index():
    outputs = [[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 2, 3]]
    pairs = near_duplicates(outputs, threshold=0.5, n=1)
    assert pairs == [(0, 1, 1.0), (0, 3, 1.0), (1, 3, 1.0), (0, 2, 0.5), (1, 2, 0.5), (2, 3, 0.5)]
    assert near_duplicate_rate(outputs, threshold=0.5, n=1) == 1.0


def test_near_duplicates_short_and_empty_outputs():
    # Shorter than n: the whole output is its single n-gram, so only exact matches count; empty never matches.
    outputs = [[1, 2], [1, 2], [1, 2, 3], [], []]
    assert near_duplicates(outputs, n=4) == [(0, 1, 1.0)]
    assert near_duplicate_rate(outputs, n=4) == pytest.approx(2 / 5)
    assert near_duplicate_rate([]) == 0.0


@pytest.mark.parametrize(
    ("text", "reasons"),
    [
        ("hello \ufffd world", ["replacement character"]),
        ("bell \x07", ["control character"]),
        ("nul \x00 and del \x7f", ["control character"]),
        ("lone \ud800 surrogate", ["invalid utf-8"]),
        ("\ufffd\x1b\udfff", ["replacement character", "control character", "invalid utf-8"]),
        ("line one\nline two\r\n\tindented, café, 日本語, emoji 🙂", []),
        ("", []),
    ],
)
def test_garbage(text, reasons):
    assert garbage(text) == reasons


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([0, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3], 2),
        ([1, 2, 3], [1, 2], 2),
        ([], [1], 0),
        ([1, 2, 3], [1, 9], 1),
    ],
)
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected


@pytest.mark.parametrize(
    ("entropies", "expected"),
    [
        ([[1.0, 2.0], [3.0]], 2.0),  # pooled over steps, not the mean of per-output means (2.25)
        ([[0.5]], 0.5),
        ([[], [4.0, 2.0]], 3.0),
        ([], 0.0),
        ([[], []], 0.0),
    ],
)
def test_mean_entropy(entropies, expected):
    assert mean_entropy(entropies) == pytest.approx(expected)
