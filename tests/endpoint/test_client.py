"""Bad endpoints get one-line errors: real HTTP servers on loopback that misbehave on purpose
(refused connections, wrong model names, 5xx, timeouts, truncated streams, missing features)."""

import asyncio
import socket

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_thread import ServerThread

from onboard.endpoint import Endpoint, EndpointError, EndpointSpec
from onboard.endpoint.scores import score_prompt

MODELS = {"object": "list", "data": [{"id": "served", "object": "model"}]}


def _app(**routes) -> FastAPI:
    app = FastAPI()
    app.state.calls = 0

    @app.get("/v1/models")
    async def models():
        return MODELS

    for path, handler in routes.items():
        app.add_api_route(f"/v1/{path}", handler, methods=["POST"])
    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_host_is_one_line() -> None:
    endpoint = Endpoint(EndpointSpec(f"http://127.0.0.1:{_free_port()}"), retries=1)
    with pytest.raises(EndpointError, match=r"cannot reach .*is the server running") as err:
        endpoint.model  # noqa: B018
    assert "\n" not in str(err.value)


def test_not_a_url() -> None:
    with pytest.raises(EndpointError, match="http:// or https://"):
        Endpoint(EndpointSpec("localhost:8000"))


def test_wrong_model_name_lists_what_is_served() -> None:
    with ServerThread(_app()) as url:
        endpoint = Endpoint(EndpointSpec(url, served_model="other"))
        with pytest.raises(EndpointError, match=r"does not serve 'other'; it serves: served"):
            endpoint.model  # noqa: B018
        assert Endpoint(EndpointSpec(f"{url}/v1")).model == "served"  # the only one, and /v1 stripped


def test_5xx_is_retried_a_bounded_number_of_times() -> None:
    async def flaky(request: Request):
        request.app.state.calls += 1
        if request.app.state.calls <= 2:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return {"ok": True}

    async def broken(request: Request):
        request.app.state.calls += 1
        return JSONResponse({"error": {"message": "engine died"}}, status_code=500)

    app = _app(completions=flaky)
    with ServerThread(app) as url:
        assert Endpoint(EndpointSpec(url), retries=3).post("/v1/completions", {}) == {"ok": True}
        assert app.state.calls == 3
    app = _app(completions=broken)
    with ServerThread(app) as url:
        with pytest.raises(EndpointError, match=r"answered 500 3 times: engine died"):
            Endpoint(EndpointSpec(url), retries=2).post("/v1/completions", {})
        assert app.state.calls == 3


def test_4xx_is_not_retried_and_keeps_the_servers_reason() -> None:
    async def refuse(request: Request):
        request.app.state.calls += 1
        return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)

    app = _app(completions=refuse)
    with ServerThread(app) as url:
        with pytest.raises(EndpointError, match=r"refused the request \(400\): bad prompt"):
            Endpoint(EndpointSpec(url)).post("/v1/completions", {})
        assert app.state.calls == 1


def test_timeout_is_one_line() -> None:
    async def slow(request: Request):
        await asyncio.sleep(2)
        return {}

    with ServerThread(_app(completions=slow)) as url:
        endpoint = Endpoint(EndpointSpec(url, timeout_s=0.2), retries=1)
        with pytest.raises(EndpointError, match=r"did not answer within 0.2 s \(2 attempts"):
            endpoint.post("/v1/completions", {})


def test_truncated_stream_is_an_error_not_a_short_answer() -> None:
    async def cut(request: Request):
        async def events():
            yield 'data: {"choices": [{"text": "a"}]}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    async def whole(request: Request):
        async def events():
            yield 'data: {"choices": [{"text": "a"}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with ServerThread(_app(completions=cut, chat=whole)) as url:
        endpoint = Endpoint(EndpointSpec(url))
        with pytest.raises(EndpointError, match=r"ended before \[DONE\] \(truncated\)"):
            list(endpoint.stream("/v1/completions", {}))
        assert len(list(endpoint.stream("/v1/chat", {}))) == 1


def test_server_without_prompt_logprobs_names_the_feature() -> None:
    async def plain(request: Request):
        return {"choices": [{"text": "x", "logprobs": None}]}

    async def capped(request: Request):
        message = "Requested prompt logprobs of 50, which is greater than max allowed: 20"
        return JSONResponse({"error": {"message": message}}, status_code=400)

    missing = pytest.raises(EndpointError, match=r"no prompt_logprobs: .*vLLM's `prompt_logprobs`")
    with ServerThread(_app(completions=plain)) as url, missing:
        score_prompt(Endpoint(EndpointSpec(url)), [1, 2, 3], 20)
    refused = pytest.raises(EndpointError, match=r"restart it with --max-logprobs 50")
    with ServerThread(_app(completions=capped)) as url, refused:
        score_prompt(Endpoint(EndpointSpec(url)), [1, 2, 3], 50)


def test_api_key_refused_says_which_flag() -> None:
    async def guarded(request: Request):
        return JSONResponse({"error": {"message": "no"}}, status_code=401)

    with ServerThread(_app(completions=guarded)) as url, pytest.raises(EndpointError, match="--api-key"):
        Endpoint(EndpointSpec(url, api_key="wrong")).post("/v1/completions", {})
