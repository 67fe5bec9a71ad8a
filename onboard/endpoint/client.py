"""One OpenAI-compatible server (vLLM, SGLang, `onboard serve`, ...) as the checks talk to it.

Every failure a user can cause or meet (a wrong URL, a wrong model name, a server that lacks a
feature, timeouts, a stream cut short, 5xx answers) becomes an `EndpointError`: one line, naming
the URL and what to do. 5xx answers, refused connections and timeouts are retried a bounded
number of times with backoff; 4xx answers are the request's fault and are not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from onboard.errors import OnboardError

RETRIES = 3  # attempts after the first, for 5xx answers, refused connections and timeouts
BACKOFF_S = 0.5  # doubled after each failed attempt


class EndpointError(OnboardError):
    """The endpoint could not answer a check's request; the message says why in one line."""


@dataclass(frozen=True)
class EndpointSpec:
    """Where the server is and how to address it (`--endpoint`, `--served-model`, `--api-key`)."""

    url: str
    served_model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def base(self) -> str:
        """The URL without a trailing `/v1`: routes are appended as `/v1/...`."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def slug(self) -> str:
        """A file-name-safe name for this endpoint and model (results go under it)."""
        raw = self.base.split("://", 1)[-1] + (f"-{self.served_model}" if self.served_model else "")
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


def _message(response: httpx.Response) -> str:
    """The server's own error text (OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, vLLM's
    {"message"}), on one line."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if isinstance(body, dict):
        err = body.get("error")
        body = (
            (err.get("message") if isinstance(err, dict) else err) or body.get("detail") or body.get("message") or body
        )
    return " ".join(str(body).split())[:300]


class Endpoint:
    """A connection to one server and one model on it. Thread-safe: the checks keep many requests in
    flight from a thread pool over one `httpx.Client`."""

    def __init__(self, spec: EndpointSpec, retries: int = RETRIES) -> None:
        if not spec.url.startswith(("http://", "https://")):
            raise EndpointError(f"--endpoint {spec.url!r}: give an http:// or https:// URL")
        self.spec = spec
        self.retries = retries
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self.client = httpx.Client(base_url=spec.base, headers=headers, timeout=spec.timeout_s, limits=limits)
        self._model: str | None = None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def model(self) -> str:
        """The served model's id: `--served-model`, checked against GET /v1/models, or the only one."""
        if self._model is None:
            served = [m.get("id") for m in self.get_json("/v1/models").get("data", [])]
            wanted = self.spec.served_model
            if wanted is not None and wanted not in served:
                raise EndpointError(
                    f"{self.spec.base} does not serve {wanted!r}; it serves: {', '.join(served) or 'none'}"
                )
            if wanted is None and len(served) != 1:
                listed = ", ".join(map(str, served)) or "none"
                raise EndpointError(
                    f"{self.spec.base} serves {len(served)} models ({listed}): pick one with --served-model"
                )
            self._model = wanted or served[0]
        return self._model

    # -- requests ---------------------------------------------------------------------------------

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None, stream: bool = False) -> httpx.Response:
        """The response to a request, after bounded retries of what a retry can fix."""
        where = f"{self.spec.base}{path}"
        delay = BACKOFF_S
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                request = self.client.build_request(method, path, json=body)
                response = self.client.send(request, stream=stream)
            except httpx.ConnectError as err:
                if last:
                    raise EndpointError(f"cannot reach {where}: {_reason(err)} (is the server running?)") from None
            except httpx.TimeoutException:
                if last:
                    raise EndpointError(
                        f"{where} did not answer within {self.spec.timeout_s:g} s ({self.retries + 1} attempts; "
                        "is the server overloaded?)"
                    ) from None
            except httpx.TransportError as err:
                if last:
                    raise EndpointError(f"{where}: the connection failed: {_reason(err)}") from None
            else:
                if response.status_code < 500:
                    if response.status_code >= 400:
                        if stream:
                            response.read()
                        raise self._client_error(where, response)
                    return response
                if stream:
                    response.read()
                if last:
                    raise EndpointError(
                        f"{where} answered {response.status_code} {self.retries + 1} times: {_message(response)}"
                    )
                response.close()
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _client_error(self, where: str, response: httpx.Response) -> EndpointError:
        status, text = response.status_code, _message(response)
        if status == 401:
            return EndpointError(f"{where} refused the API key (401): pass the right one with --api-key")
        if status == 404 and "model" in text.lower():
            return EndpointError(f"{where}: model {self.spec.served_model!r} not found (404): {text}")
        if status == 404:
            return EndpointError(f"{where} has no such route (404): is this an OpenAI-compatible server?")
        return EndpointError(f"{where} refused the request ({status}): {text}")

    def get_json(self, path: str) -> dict[str, Any]:
        response = self._send("GET", path)
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{self.spec.base}{path} did not answer JSON") from None

    def get_text(self, path: str) -> str:
        return self._send("GET", path).text

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a JSON body (the model filled in); the JSON answer."""
        response = self._send("POST", path, {"model": self.model, **body})
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{self.spec.base}{path} did not answer JSON") from None

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The server-sent events of a streamed request, parsed; an `EndpointError` if the stream
        ends before `data: [DONE]` (a truncated stream is never taken for a finished one)."""
        response = self._send("POST", path, {"model": self.model, **body, "stream": True}, stream=True)
        where = f"{self.spec.base}{path}"
        try:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise EndpointError(f"{where}: the stream reported an error: {_message_of(event)}")
                yield event
        except (httpx.TransportError, json.JSONDecodeError) as err:
            raise EndpointError(f"{where}: the stream broke off: {_reason(err)}") from None
        finally:
            response.close()
        raise EndpointError(f"{where}: the stream ended before [DONE] (truncated)")


def _message_of(event: dict[str, Any]) -> str:
    err = event.get("error")
    return str(err.get("message") if isinstance(err, dict) else err)


def _reason(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text[:200]
