"""The OpenAI-compatible server, end to end: a real uvicorn on a free loopback port over the tiny llama,
driven by the official `openai` client (and httpx where the client cannot send what we want).
"""

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_thread import ServerThread

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.server import build_app

MODEL = "tiny-llama"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[tuple[str, object]]:
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=MAX_MODEL_LEN, num_blocks=128))
    app = build_app(engine, MODEL, api_key=API_KEY)
    with ServerThread(app) as url:
        yield url, app.state.server


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def engine_idle(server_state, timeout: float = 10.0) -> tuple[int, int]:
    """Wait until the engine has nothing to do; (free blocks, all blocks), invariants checked."""

    def probe(engine: LLMEngine) -> tuple[bool, int, int]:
        if not engine.has_unfinished():
            engine._block_manager.check_invariants([])
        return engine.has_unfinished(), engine.stats()["num_free_blocks"], engine.config.num_blocks

    deadline = time.monotonic() + timeout
    while True:
        busy, free, total = server_state.loop.call(probe).result(timeout)
        if not busy or time.monotonic() > deadline:
            return free, total
        time.sleep(0.02)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_reassembles_to_the_same_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24


def test_completions_with_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=6, logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and max(top.values()) >= logprob - 1e-4  # greedy: the sampled one is the best
        assert token in top
    # Token ids as the prompt, and a seeded random draw that repeats.
    seeded = dict(model=MODEL, prompt=[1, 40, 50, 60], max_tokens=8, temperature=1.0, seed=7)
    assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"color", "ok"} and value["color"] in schema["properties"]["color"]["enum"]
    assert isinstance(value["ok"], bool)


def test_structured_outputs_regex_and_choice(client: openai.OpenAI) -> None:
    pattern = r"(yes|no)-[0-9]{3}"
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, extra_body={"structured_outputs": {"regex": pattern}}
    )
    assert re.fullmatch(pattern, r.choices[0].message.content)
    choices = ["Paris", "Lyon", 'say "hi"']
    r = client.completions.create(
        model=MODEL, prompt="Capital:", max_tokens=16, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert r.choices[0].text in choices


def test_disconnect_mid_stream_aborts_the_request(url: str, http: httpx.Client, server) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk; then hang up long before 200 tokens
    free, total = engine_idle(server[1])
    assert free == total
    assert re.search(r'request_finished_total\{reason="abort"\} [1-9]', http.get("/metrics").text)


def _post(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, str | bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 60


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, '{"model": "tiny-llama", "messages": [', None),  # malformed JSON
        (CHAT, "[1, 2]", None),
        (CHAT, {"model": MODEL}, "messages"),
        (CHAT, {"model": MODEL, "messages": []}, "messages"),
        (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": -1}, "temperature"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "top_p": 2}, "top_p"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "n": 2}, "n"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "top_k": 10**30}, "top_k"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "seed": 2**70}, "seed"),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, None),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": MESSAGES,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}},
            },
            None,
        ),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "structured_outputs": {"regex": "(unclosed"}}, None),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "structured_outputs": {"json": "{not json"}}, None),
        (COMPLETIONS, {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8}, None),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "n": 2}, "n"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
        (COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 10**6]}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": ""}, None),
        (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ],
)
def test_bad_requests_are_400_with_the_openai_error_shape(http: httpx.Client, path: str, body, param) -> None:
    response = _post(http, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_openai_client_raises_bad_request_and_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=16)


def test_api_key_is_required(url: str, client: openai.OpenAI) -> None:
    for key in (None, "sk-wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/metrics"), ("GET", "/nowhere")):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401, (key, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert httpx.get(url + "/health").status_code == 200  # open on purpose: probes carry no key


def test_metrics_and_health(http: httpx.Client, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/v1/unknown").status_code == 404
    text = http.get("/metrics").text
    for family in (
        "onboard_http_requests_total",
        "onboard_time_to_first_token_seconds_bucket",
        "onboard_time_per_output_token_seconds_count",
        "onboard_num_requests_running",
        "onboard_num_requests_waiting",
        "onboard_kv_cache_usage_perc",
        "onboard_prefix_cache_hit_rate",
    ):
        assert family in text
    assert re.search(r'onboard_http_requests_total\{route="/v1/completions",code="200"\} [1-9]', text)
    assert re.search(r"onboard_time_to_first_token_seconds_count [1-9]", text)


def test_a_failing_engine_gives_503_and_unhealthy_not_a_hang(tiny_llama: Path) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=MAX_MODEL_LEN, num_blocks=32))

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step
    with ServerThread(build_app(engine, MODEL)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(2):  # the failing request, then one refused by the dead engine
            with pytest.raises(openai.APIStatusError) as failed:
                c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            assert failed.value.status_code == 503 and failed.value.body["type"] == "server_error"
        assert httpx.get(f"{base}/health").status_code == 503
