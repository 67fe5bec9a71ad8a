"""A speculator's acceptance in a running server, read from its Prometheus counters.

vLLM (and `onboard serve`) count, since start-up, the drafts verified, the tokens they proposed,
the tokens accepted, and the tokens accepted at each draft position. Read before and after a
workload, the differences give the workload's acceptance length, 1 + accepted / drafts, and its
per-position acceptance, accepted at position i / drafts: the figures vLLM's own logs print and
the in-process measurement (`onboard.speculator.measure`) reports.

The counters are server-wide, so the workload is attributable only while nothing else runs on
the server: each traffic type is one workload, sent after the previous one finished, greedy, one
request at a time by default. A reading is taken once the counters stop moving: a server may
publish them a moment after the last response went out (vLLM's logging, `onboard serve`'s
engine loop).
"""

from __future__ import annotations

import time
from typing import Any

from onboard.console import console
from onboard.data.prompts import ChatPrompt
from onboard.endpoint.client import Endpoint, EndpointError
from onboard.endpoint.pool import in_flight
from onboard.endpoint.prometheus import ZERO, SpecCounters, parse, spec_counters

SETTLE_S = 0.05  # between readings while waiting for the counters to stop moving
SETTLE_TRIES = 40


def no_counters_error(endpoint: Endpoint) -> EndpointError:
    return EndpointError(
        f"{endpoint.spec.base}/metrics: the server reports no speculative-decoding counters: was it started "
        'with a speculator? (vLLM: --speculative-config \'{"model": DRAFT, "num_speculative_tokens": K}\'; '
        "onboard serve: --speculator DRAFT)"
    )


def read_counters(endpoint: Endpoint) -> SpecCounters:
    """The server's speculative-decoding counters now, or a one-line EndpointError."""
    try:
        text = endpoint.get_text("/metrics")
    except EndpointError as err:
        if "(404)" in str(err):
            raise EndpointError(
                f"{endpoint.spec.base}/metrics not found (404): the server exposes no Prometheus metrics, "
                "which the acceptance is read from"
            ) from None
        raise
    counters = spec_counters(parse(text), endpoint.model)
    if counters is None:
        raise no_counters_error(endpoint)
    return counters


def settled_counters(endpoint: Endpoint) -> SpecCounters:
    """The counters once two readings SETTLE_S apart agree (the latest after SETTLE_TRIES)."""
    last = read_counters(endpoint)
    for _ in range(SETTLE_TRIES):
        time.sleep(SETTLE_S)
        now = read_counters(endpoint)
        if now == last:
            return now
        last = now
    console.print(
        f"[yellow]warning[/]: {endpoint.spec.base}'s speculative-decoding counters kept moving: other traffic "
        "on the server is counted in the acceptance"
    )
    return last


def greedy_body(token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """As the in-process measurement decodes: greedy, up to `max_tokens`, stopping at EOS."""
    return {"prompt": list(token_ids), "max_tokens": max_tokens, "temperature": 0.0}


def summary(delta: SpecCounters) -> dict[str, Any]:
    """Acceptance length and per-position acceptance of a counter difference (1.0, no positions'
    worth, for no drafts, as the in-process measurement reports it)."""
    drafts = max(delta.num_drafts, 1.0)
    return {
        "acceptance_length": 1.0 + delta.num_accepted_tokens / drafts,
        "per_position_acceptance": [n / drafts for n in delta.accepted_per_position],
        "num_drafts": _count(delta.num_drafts),
        "num_draft_tokens": _count(delta.num_draft_tokens),
        "num_accepted_tokens": _count(delta.num_accepted_tokens),
    }


def _count(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def measure_endpoint_acceptance(
    endpoint: Endpoint, prompts: list[ChatPrompt], max_tokens: int, concurrency: int = 1
) -> dict[str, Any]:
    """Acceptance of the server's speculator on `prompts` (token ids, as every server then sees the
    same input), overall and per traffic type, from its counters around each traffic's workload."""
    settled_counters(endpoint)  # no counters: the one-line error before any request is sent
    groups: dict[str, list[ChatPrompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.traffic, []).append(prompt)
    by_traffic: dict[str, dict[str, Any]] = {}
    overall, tokens = ZERO, 0
    for traffic, group in sorted(groups.items()):
        before = settled_counters(endpoint)

        def send(prompt: ChatPrompt) -> int:
            answer = endpoint.post("/v1/completions", greedy_body(prompt.token_ids, max_tokens))
            return int((answer.get("usage") or {}).get("completion_tokens", 0))

        generated = in_flight(group, send, concurrency, f"{traffic} on {endpoint.spec.base}")
        delta = settled_counters(endpoint) - before
        by_traffic[traffic] = {**summary(delta), "num_prompts": len(group), "num_tokens": sum(generated)}
        overall, tokens = overall + delta, tokens + sum(generated)
    if overall.num_drafts <= 0:
        raise EndpointError(
            f"{endpoint.spec.base}: the speculative-decoding counters did not move over {len(prompts)} requests: "
            "is speculative decoding on for this model?"
        )
    k = len(overall.accepted_per_position)
    return {
        **summary(overall),
        "num_speculative_tokens": k or None,
        "num_prompts": len(prompts),
        "num_tokens": tokens,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "by_traffic": by_traffic,
    }
