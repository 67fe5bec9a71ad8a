"""`onboard bench PATH --endpoint URL ...`: the load generator against real `onboard serve` apps on
loopback. What it counts must add up against what the servers count on /metrics."""

import json
from pathlib import Path

import httpx
import pytest
import torch
from cli_run import onboard, one_line_error
from server_thread import ServerThread

from onboard.endpoint import Endpoint, EndpointSpec
from onboard.endpoint.load import RequestTiming, distribution, sweep
from onboard.endpoint.prometheus import parse, total
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.server import build_app

MAX_TOKENS = 6


def _server(model: Path, name: str):
    engine = LLMEngine(model, EngineConfig(max_model_len=512, num_blocks=256), dtype=torch.float32)
    return ServerThread(build_app(engine, name))


def _counts(url: str) -> tuple[float, float, float]:
    """(requests finished by length, all finished, generated tokens) as the server counts them."""
    samples = parse(httpx.get(f"{url}/metrics", timeout=30).text)
    return (
        total(samples, "request_finished", reason="length") or 0.0,
        total(samples, "request_finished") or 0.0,
        total(samples, "generation_tokens") or 0.0,
    )


def _ordered(dist: dict) -> bool:
    return dist["p50"] <= dist["p90"] <= dist["p99"]


def test_two_endpoints_side_by_side_add_up_against_their_metrics(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "serve.json"
    with _server(tiny_llama, "a") as url_a, _server(tiny_llama, "b") as url_b:
        before = {url: _counts(url) for url in (url_a, url_b)}
        argv = ["bench", str(tiny_llama), "--endpoint", url_a, "--endpoint", f"{url_b}/v1"]
        argv += ["--served-model", "a", "--served-model", "b", "--concurrency", "4,1"]
        argv += ["--max-tokens", str(MAX_TOKENS), "--out", str(out)]
        code, _, stderr = onboard(argv, capsys)
        assert code == 0, stderr
        after = {url: _counts(url) for url in (url_a, url_b)}
    result = json.loads(out.read_text())
    assert result["ignore_eos"] is True and result["concurrency"] == [1, 4]
    assert [e["served_model"] for e in result["endpoints"]] == ["a", "b"]
    # Levels in order, endpoint by endpoint within each; 4 x concurrency requests, at least 8.
    rows = [(level["endpoint"], level["served_model"], level["concurrency"]) for level in result["levels"]]
    assert rows == [(url_a, "a", 1), (url_b, "b", 1), (url_a, "a", 4), (url_b, "b", 4)]
    assert [level["num_requests"] for level in result["levels"]] == [8, 8, 16, 16]
    for url, model in ((url_a, "a"), (url_b, "b")):
        levels = [level for level in result["levels"] if level["endpoint"] == url]
        (warmup,) = [w for w in result["warmup"] if w["endpoint"] == url]
        requests = 1 + sum(level["num_requests"] for level in levels)
        tokens = warmup["output_tokens"] + sum(level["output_tokens"] for level in levels)
        length, finished, generated = (a - b for a, b in zip(after[url], before[url], strict=True))
        assert length == finished == requests  # every request ran to max_tokens (ignore_eos), none failed
        assert generated == tokens == requests * MAX_TOKENS
        for level in levels:
            assert level["served_model"] == model and level["num_failed"] == 0 and level["tokens_from"] == "usage"
            assert level["output_tokens"] == level["num_requests"] * MAX_TOKENS
            for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
                assert _ordered(level[key]), (key, level[key])
            assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p99"]
            assert level["output_tokens_per_s"] == pytest.approx(level["output_tokens"] / level["duration_s"])
            assert level["requests_per_s"] == pytest.approx(level["num_requests"] / level["duration_s"])
    # The table, on the console (stderr): a row per endpoint and concurrency.
    assert "TTFT" in stderr and all(url.split("://")[1] in stderr for url in (url_a, url_b))


def test_sweep_times_every_request_and_keeps_endpoints_on_the_same_prompts(tiny_llama: Path) -> None:
    from onboard.bench.serve import load_prompts
    from onboard.models import inspect_checkpoint, load_tokenizer

    prompts = load_prompts(load_tokenizer(inspect_checkpoint(tiny_llama)), None, 12)
    with _server(tiny_llama, "m") as url:
        before = _counts(url)
        with Endpoint(EndpointSpec(url), retries=0) as endpoint:
            result = sweep([endpoint], prompts, [2, 3], MAX_TOKENS, num_requests=5)
        after = _counts(url)
    assert [level["num_requests"] for level in result["levels"]] == [5, 5]
    assert after[2] - before[2] == 11 * MAX_TOKENS and after[1] - before[1] == 11
    for level in result["levels"]:
        assert level["prompt_tokens"] > 0 and level["duration_s"] > 0
        # One gap per chunk after the first; with the server's usage, as many chunks as tokens at most.
        assert level["ttft_ms"]["mean"] > 0 and level["e2e_ms"]["p50"] >= level["ttft_ms"]["p50"]


def test_time_per_output_token_and_distribution() -> None:
    timing = RequestTiming(prompt_tokens=3, output_tokens=5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1] * 4)
    assert timing.tpot_s == pytest.approx(0.1)
    assert RequestTiming(prompt_tokens=3, output_tokens=1, ttft_s=0.1, e2e_s=0.1).tpot_s is None
    dist = distribution([0.001 * i for i in range(1, 101)])
    assert dist["p50"] == pytest.approx(50.5) and dist["p99"] == pytest.approx(99.01) and _ordered(dist)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_served_model_pairing_and_endpoint_only_options(tiny_llama: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["bench", str(tiny_llama), "--endpoint", "http://127.0.0.1:1", "--endpoint", "http://127.0.0.1:2"]
    code, _, stderr = onboard([*argv, "--served-model", "a", "--served-model", "b", "--served-model", "c"], capsys)
    assert code == 2 and "2 --endpoint and 3 --served-model" in one_line_error(stderr)
    code, _, stderr = onboard(["bench", str(tiny_llama), "--concurrency", "1,4"], capsys)
    assert code == 2 and "--concurrency needs --endpoint" in one_line_error(stderr)
    code, _, stderr = onboard([*argv[:4], "--concurrency", "0"], capsys)
    assert code == 2 and "--concurrency '0'" in one_line_error(stderr)
