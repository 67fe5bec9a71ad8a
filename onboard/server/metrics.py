"""Server metrics in the Prometheus text format (version 0.0.4), written by hand.

Counters and histograms are updated from two threads (HTTP handlers, the engine thread), so every
update holds one lock. Engine gauges come from an `EngineStats` snapshot that the engine thread
publishes after each step; reading it never touches the engine itself.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass

PREFIX = "onboard"
# Seconds; the same spirit as vLLM's buckets, cut to what a CPU or one GPU can show.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like after its latest step (published whole, read without a lock)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_bytes_per_token: int = 0  # the model's KV layout, all layers and cached tensors
    prefix_caching: bool = True  # off for a model with per-sequence state
    # Linear attention's per-sequence state pool (0 for a model without one).
    state_bytes_per_sequence: int = 0
    state_slots: int = 0
    state_slots_used: int = 0
    num_in_flight: int = 0  # requests the server still streams to
    # Speculative decoding (vLLM's spec_decode_* counters); None when serving without a draft.
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http_requests: Counter[tuple[str, int]] = Counter()  # (route, status code)
        self.finished: Counter[str] = Counter()  # finish reason: stop | length | abort | error
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.engine = EngineStats()

    # -- updates (any thread) -----------------------------------------------------------------

    def count_http(self, route: str, status: int) -> None:
        with self._lock:
            self.http_requests[route, status] += 1

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_next_tokens(self, seconds: float, num_tokens: int) -> None:
        with self._lock:
            for _ in range(num_tokens):
                self.tpot.observe(seconds / num_tokens)

    def observe_finished(self, reason: str, seconds: float, num_prompt_tokens: int, num_generated: int) -> None:
        with self._lock:
            self.finished[reason] += 1
            self.e2e.observe(seconds)
            self.prompt_tokens += num_prompt_tokens
            self.generation_tokens += num_generated

    def publish(self, stats: EngineStats) -> None:
        self.engine = stats  # one reference swap: readers see the old or the new snapshot, whole

    # -- exposition ---------------------------------------------------------------------------

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"])
            lines.extend(f"{PREFIX}_{s}" for s in samples)

        e = self.engine
        with self._lock:
            http = sorted(self.http_requests.items())
            finished = sorted(self.finished.items())
            family(
                "http_requests_total",
                "counter",
                "HTTP requests by route and status code.",
                [f'http_requests_total{{route="{_escape(r)}",code="{c}"}} {n}' for (r, c), n in http],
            )
            family(
                "request_finished_total",
                "counter",
                "Generation requests finished, by finish reason (stop, length, abort, error).",
                [f'request_finished_total{{reason="{_escape(r)}"}} {n}' for r, n in finished],
            )
            family(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                [f"prompt_tokens_total {self.prompt_tokens}"],
            )
            family(
                "generation_tokens_total",
                "counter",
                "Generated tokens of finished requests.",
                [f"generation_tokens_total {self.generation_tokens}"],
            )
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Seconds from arrival to the first generated token."),
                ("time_per_output_token_seconds", self.tpot, "Seconds between generated tokens after the first."),
                ("e2e_request_latency_seconds", self.e2e, "Seconds from arrival to the end of a request."),
            ):
                family(
                    name, "histogram", help_text, [s.removeprefix(f"{PREFIX}_") for s in hist.lines(f"{PREFIX}_{name}")]
                )
        gauges = (
            ("num_requests_running", "Sequences the scheduler runs.", e.num_running),
            ("num_requests_waiting", "Sequences waiting for admission (or preempted).", e.num_waiting),
            ("num_requests_in_flight", "Requests the server is still answering.", e.num_in_flight),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", e.kv_cache_usage),
            ("kv_cache_free_blocks", "Free KV-cache blocks.", e.num_free_blocks),
            ("kv_cache_total_blocks", "All KV-cache blocks.", e.num_blocks),
            ("kv_cache_bytes_per_token", "KV-cache bytes one token takes, all layers.", e.kv_bytes_per_token),
            (
                "prefix_caching_enabled",
                "1 when cached prefixes are reused (0: off, or a stateful model).",
                int(e.prefix_caching),
            ),
            (
                "state_bytes_per_sequence",
                "Per-sequence state (linear attention) one sequence holds.",
                e.state_bytes_per_sequence,
            ),
            ("state_slots_total", "Per-sequence state slots (0: the model has no state).", e.state_slots),
            ("state_slots_used", "Per-sequence state slots held by running sequences.", e.state_slots_used),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up.",
                e.prefix_cache_hit_rate,
            ),
        )
        for name, help_text, value in gauges:
            family(name, "gauge", help_text, [f"{name} {value}"])
        family(
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            [f"prefix_cache_queries_total {e.prefix_cache_queries}"],
        )
        family(
            "prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            [f"prefix_cache_hits_total {e.prefix_cache_hits}"],
        )
        family(
            "num_preemptions_total",
            "counter",
            "Sequences preempted for KV-cache space.",
            [f"num_preemptions_total {e.num_preemptions}"],
        )
        if e.spec_num_drafts is not None:
            for name, help_text, value in (
                ("spec_decode_num_drafts_total", "Verification rounds of draft proposals.", e.spec_num_drafts),
                ("spec_decode_num_draft_tokens_total", "Tokens the draft proposed.", e.spec_num_draft_tokens),
                (
                    "spec_decode_num_accepted_tokens_total",
                    "Proposed tokens the target accepted.",
                    e.spec_num_accepted_tokens,
                ),
            ):
                family(name, "counter", help_text, [f"{name} {value}"])
            name = "spec_decode_num_accepted_tokens_per_pos_total"
            family(
                name,
                "counter",
                "Proposed tokens accepted, by position in the draft (0 first).",
                [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(e.spec_accepted_per_position)],
            )
        return "\n".join(lines) + "\n"
