"""A server's /metrics in the Prometheus text format, and the counters the checks read from it.

Parsed here by hand: `prometheus_client` (whose `parser.text_string_to_metric_families` would do)
is not a dependency of this project, and the checks need only the samples' names, labels and
values, not types or histograms.

Names are compared without their namespace (`vllm:` for vLLM, `onboard_` for `onboard serve`)
and without the `_total` that counters are exposed with, so `vllm:spec_decode_num_drafts_total`,
`onboard_spec_decode_num_drafts_total` and `spec_decode_num_drafts` are the same counter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

NAMESPACES = ("vllm:", "onboard_")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed, e.g. vllm:spec_decode_num_drafts_total
    labels: dict[str, str]
    value: float

    @property
    def base(self) -> str:
        return base_name(self.name)


def base_name(name: str) -> str:
    """`vllm:generation_tokens_total` -> `generation_tokens`."""
    for namespace in NAMESPACES:
        if name.startswith(namespace):
            name = name[len(namespace) :]
            break
    return name.removesuffix("_total")


def parse(text: str) -> list[Sample]:
    """Every sample line of an exposition (comments and malformed lines skipped)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, raw_labels, raw_value = match.groups()
        try:
            value = float(raw_value)  # also +Inf, -Inf, NaN
        except ValueError:
            continue
        labels = {
            key: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], val)
            for key, val in _LABEL.findall(raw_labels or "")
        }
        samples.append(Sample(name, labels, value))
    return samples


def _of_model(samples: Iterable[Sample], model: str | None) -> list[Sample]:
    """vLLM labels its series with `model_name`: keep the served model's and the unlabelled ones.
    All of them when no series names `model` (vLLM labels with the first of several
    --served-model-name aliases, which need not be the one asked for)."""
    samples = list(samples)
    if model is None or not any(s.labels.get("model_name") == model for s in samples):
        return samples
    return [s for s in samples if s.labels.get("model_name", model) == model]


def total(samples: Iterable[Sample], name: str, model: str | None = None, **labels: str) -> float | None:
    """The sum of a counter's series (over engines, ...) whose labels include `labels`; None when
    the server exposes no such counter."""
    wanted = base_name(name)
    found = [
        s
        for s in _of_model(samples, model)
        if s.base == wanted and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(s.value for s in found) if found else None


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters (`spec_decode_num_*`): cumulative since the server
    started; subtract two readings for what a workload did."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: tuple[float, ...]

    def _combine(self, other: SpecCounters, sign: float) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine, theirs = _pad(self.accepted_per_position, width), _pad(other.accepted_per_position, width)
        return SpecCounters(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            tuple(a + sign * b for a, b in zip(mine, theirs, strict=True)),
        )

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1.0)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1.0)


def _pad(values: tuple[float, ...], width: int) -> tuple[float, ...]:
    return values + (0.0,) * (width - len(values))


ZERO = SpecCounters(0.0, 0.0, 0.0, ())


def spec_counters(samples: Iterable[Sample], model: str | None = None) -> SpecCounters | None:
    """The speculative-decoding counters, or None when the server exposes none (no draft)."""
    samples = _of_model(samples, model)
    drafts = total(samples, "spec_decode_num_drafts")
    if drafts is None:
        return None
    per_position: dict[int, float] = {}
    for s in samples:
        if s.base == "spec_decode_num_accepted_tokens_per_pos" and s.labels.get("position", "").isdigit():
            position = int(s.labels["position"])
            per_position[position] = per_position.get(position, 0.0) + s.value
    width = max(per_position, default=-1) + 1
    return SpecCounters(
        drafts,
        total(samples, "spec_decode_num_draft_tokens") or 0.0,
        total(samples, "spec_decode_num_accepted_tokens") or 0.0,
        tuple(per_position.get(i, 0.0) for i in range(width)),
    )
