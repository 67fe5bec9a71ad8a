"""Load generation against OpenAI-compatible servers: latency and throughput at fixed concurrency,
measured as `vllm bench serve` and GuideLLM measure them.

Each request is a streamed `/v1/completions` of a chat-templated prompt given as token ids (so
every server sees the same input, whatever its own chat template or tokenizer), `max_tokens` long
with `ignore_eos: true` (vLLM, SGLang and `onboard serve` accept it), so every request generates
the same number of tokens. Per request:

- TTFT, time to first token: from sending the request to the first chunk carrying a choice;
- ITL, inter-token latencies: the gaps between successive chunks (a chunk may carry several
  tokens: a speculator's accepted run, or text held back by the detokenizer);
- TPOT, time per output token: (e2e - TTFT) / (output tokens - 1);
- e2e, the request's whole latency.

Output tokens are the server's own count (`usage`, asked for with `stream_options:
{include_usage: true}`), else the number of chunks. A level is `num_requests` requests kept
`concurrency` in flight (a closed loop: each finished request starts the next); its throughput
is over its wall time. Requests that fail are counted, not timed.

The client is threads over one `httpx.Client`; at high concurrency its own overhead (the GIL,
parsing events) can add to the latencies it reports, as any Python load generator's does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onboard.endpoint.client import Endpoint, EndpointError
from onboard.endpoint.pool import in_flight

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    """One request as the client saw it (seconds, from `time.perf_counter`)."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens_from: str = "usage"  # "usage": the server's count; "chunks": the number of chunks
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def load_body(token_ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": list(token_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # every request generates max_tokens tokens (vLLM's and SGLang's extension)
        "stream_options": {"include_usage": True},
    }


def timed_request(endpoint: Endpoint, token_ids: Sequence[int], max_tokens: int) -> RequestTiming:
    """One streamed completion, timed; a failure is returned as a timing with its error."""
    timing = RequestTiming(prompt_tokens=len(token_ids))
    body = load_body(token_ids, max_tokens)
    chunks, usage = 0, None
    start = last = time.perf_counter()
    try:
        for event in endpoint.stream("/v1/completions", body):
            now = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
            if not event.get("choices"):
                continue
            if chunks == 0:
                timing.ttft_s = now - start
            else:
                timing.itl_s.append(now - last)
            chunks, last = chunks + 1, now
    except EndpointError as err:
        timing.error = str(err)
        return timing
    timing.e2e_s = time.perf_counter() - start
    if chunks == 0:
        timing.error = f"{endpoint.spec.base}/v1/completions streamed no tokens"
    elif usage and usage.get("completion_tokens") is not None:
        timing.output_tokens = int(usage["completion_tokens"])
    else:
        timing.output_tokens, timing.tokens_from = chunks, "chunks"
    return timing


@dataclass
class Level:
    """One endpoint at one concurrency: every request's timing and the level's wall time."""

    endpoint: str
    served_model: str
    concurrency: int
    timings: list[RequestTiming]
    duration_s: float

    def summary(self) -> dict[str, Any]:
        ok = [t for t in self.timings if t.ok]
        output_tokens = sum(t.output_tokens for t in ok)
        failed = [t for t in self.timings if not t.ok]
        return {
            "endpoint": self.endpoint,
            "served_model": self.served_model,
            "concurrency": self.concurrency,
            "num_requests": len(ok),
            "num_failed": len(failed),
            "first_error": failed[0].error if failed else None,
            "prompt_tokens": sum(t.prompt_tokens for t in ok),
            "output_tokens": output_tokens,
            "tokens_from": "chunks" if any(t.tokens_from == "chunks" for t in ok) else "usage",
            "duration_s": self.duration_s,
            "output_tokens_per_s": output_tokens / self.duration_s if self.duration_s else 0.0,
            "requests_per_s": len(ok) / self.duration_s if self.duration_s else 0.0,
            "ttft_ms": distribution([t.ttft_s for t in ok]),
            "itl_ms": distribution([gap for t in ok for gap in t.itl_s]),
            "tpot_ms": distribution([t.tpot_s for t in ok if t.tpot_s is not None]),
            "e2e_ms": distribution([t.e2e_s for t in ok]),
        }


def distribution(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles, in milliseconds (None where there is nothing to summarize)."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return dict(zip(keys, [float(ms.mean()), *(float(v) for v in np.percentile(ms, PERCENTILES))], strict=True))


def run_level(endpoint: Endpoint, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int) -> Level:
    """Every prompt once, `concurrency` in flight at a time."""
    label = f"{endpoint.spec.base} ({endpoint.model}) x{concurrency}"
    start = time.perf_counter()
    timings = in_flight(list(prompts), lambda ids: timed_request(endpoint, ids, max_tokens), concurrency, label)
    duration = time.perf_counter() - start
    level = Level(endpoint.spec.base, endpoint.model, concurrency, timings, duration)
    if not any(t.ok for t in timings):
        raise EndpointError(f"every request at concurrency {concurrency} failed; the first: {timings[0].error}")
    return level


def requests_per_level(concurrency: int, num_requests: int | None = None) -> int:
    """`num_requests`, or 4 x concurrency (at least 8): enough for the level to reach a steady state."""
    return num_requests if num_requests is not None else max(8, 4 * concurrency)


def sweep(
    endpoints: Sequence[Endpoint],
    prompts: Sequence[Sequence[int]],
    concurrencies: Sequence[int],
    max_tokens: int,
    num_requests: int | None = None,
) -> dict[str, Any]:
    """Every endpoint at every concurrency, side by side: one warm-up request each first, then the
    levels in order, endpoint by endpoint within a level (so a drift of the machine over the run
    hits every endpoint alike). All endpoints get the same prompts in the same order; successive
    levels take the prompts after the previous level's (cycling), so a prefix cache does not see
    the same prompts again from one level to the next."""
    if not prompts:
        raise ValueError("no prompts")
    warmups = []
    for endpoint in endpoints:
        endpoint.model  # noqa: B018  (a wrong URL or model name fails here, in one line)
        timing = timed_request(endpoint, prompts[0], max_tokens)
        if not timing.ok:
            raise EndpointError(f"the warm-up request failed: {timing.error}")
        warmups.append(
            {
                "endpoint": endpoint.spec.base,
                "served_model": endpoint.model,
                "output_tokens": timing.output_tokens,
                "e2e_ms": timing.e2e_s * 1e3,
            }
        )
    levels, offset = [], 1
    for concurrency in concurrencies:
        count = requests_per_level(concurrency, num_requests)
        chosen = [prompts[(offset + i) % len(prompts)] for i in range(count)]
        offset += count
        for endpoint in endpoints:
            levels.append(run_level(endpoint, chosen, concurrency, max_tokens).summary())
    return {"warmup": warmups, "levels": levels}
