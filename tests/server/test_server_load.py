"""Load on the real server (loopback only): many concurrent streams, a third of them hanging up after the
first chunk, malformed bodies and oversized prompts mixed in. No 5xx, the server stays healthy, and once
everything has ended every KV-cache block is free again.
"""

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_thread import ServerThread

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.server import build_app

MODEL = "tiny-llama"
NUM_STREAMS = 72
NUM_MALFORMED = 8
NUM_OVERSIZED = 8
MAX_TOKENS = 16
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[tuple[str, object]]:
    config = EngineConfig(max_model_len=256, num_blocks=512, max_num_seqs=64, max_num_batched_tokens=1024)
    app = build_app(LLMEngine(tiny_llama, config), MODEL)
    with ServerThread(app) as url:
        yield url, app.state.server


async def _stream(client: httpx.AsyncClient, i: int, hang_up: bool) -> tuple[str, int, int]:
    """One streaming chat; ("stream"|"hangup", status, content chunks seen)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Request {i}: tell me about the weather today."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "ignore_eos": True,
    }
    async with client.stream("POST", CHAT, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return "stream", response.status_code, 0
        chunks, done = 0, False
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            chunks += 1
            if hang_up:
                return "hangup", response.status_code, chunks  # leaving the block closes the connection
        assert done, f"stream {i} ended without [DONE]"
        return "stream", response.status_code, chunks


async def _malformed(client: httpx.AsyncClient, i: int) -> tuple[str, int, int]:
    bodies = ['{"model": "tiny-llama", "messages": [', "null", '{"messages": "hi"}', '{"model": 5}']
    response = await client.post(CHAT, content=bodies[i % len(bodies)], headers={"Content-Type": "application/json"})
    assert response.json()["error"]["type"] == "invalid_request_error"
    return "malformed", response.status_code, 0


async def _oversized(client: httpx.AsyncClient, i: int) -> tuple[str, int, int]:
    prompt = f"{i} The quick brown fox jumps over the lazy dog." * 40
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": i % 2 == 0}
    response = await client.post(CHAT, json=body)
    assert "context length" in response.json()["error"]["message"]
    return "oversized", response.status_code, 0


async def _storm(url: str) -> list[tuple[str, int, int]]:
    rng = random.Random(0)
    hang_ups = set(rng.sample(range(NUM_STREAMS), NUM_STREAMS // 3))
    limits = httpx.Limits(max_connections=NUM_STREAMS + 32, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(60.0)) as client:
        jobs = [_stream(client, i, i in hang_ups) for i in range(NUM_STREAMS)]
        jobs += [_malformed(client, i) for i in range(NUM_MALFORMED)]
        jobs += [_oversized(client, i) for i in range(NUM_OVERSIZED)]
        rng.shuffle(jobs)
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)


def test_concurrent_streams_with_hangups_and_bad_requests(served) -> None:
    url, state = served
    started = time.monotonic()
    results = asyncio.run(_storm(url))
    elapsed = time.monotonic() - started

    statuses = {(kind, status) for kind, status, _ in results}
    assert all(status < 500 for _, status in statuses), statuses
    assert statuses <= {("stream", 200), ("hangup", 200), ("malformed", 400), ("oversized", 400)}, statuses
    full = [chunks for kind, _, chunks in results if kind == "stream"]
    assert len(full) == NUM_STREAMS - NUM_STREAMS // 3
    assert all(chunks >= 1 for chunks in full)
    assert elapsed < 60

    # Every request has ended (finished or aborted): the engine is idle and holds no KV block.
    def probe(engine: LLMEngine) -> tuple[bool, int, int]:
        if not engine.has_unfinished():
            engine._block_manager.check_invariants([])
        return engine.has_unfinished(), engine.stats()["num_free_blocks"], engine.config.num_blocks

    deadline = time.monotonic() + 15
    while (snapshot := state.loop.call(probe).result(15))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    busy, free, total = snapshot
    assert not busy and free == total

    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert f"onboard_kv_cache_free_blocks {total}" in metrics
    assert "onboard_num_requests_in_flight 0" in metrics
    assert not re.search(r'code="5\d\d"', metrics)
    finished = dict(re.findall(r'onboard_request_finished_total\{reason="(\w+)"\} (\d+)', metrics))
    assert int(finished.get("length", 0)) + int(finished.get("abort", 0)) == NUM_STREAMS, finished
    assert int(finished.get("abort", 0)) >= 1, finished  # hang-ups land long before 16 tokens at batch 64
