"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Client mistakes are 400 (FastAPI's 422 for a body that fails validation, malformed JSON included,
becomes 400 here), an unknown model 404 with code `model_not_found`, a missing or wrong API key 401.
A 500 means a bug on our side, never bad input.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("onboard.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}


class APIError(Exception):
    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None, type_: str = ""
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status, headers=headers)


def bad_value(err: ValueError, fields: set[str] | None = None) -> APIError:
    """A 400 from a ValueError, naming the field when the message starts with one ("top_p must be ...",
    "logprobs: requested ...")."""
    message = str(err) or "invalid request"
    first = message.split(" ", 1)[0].rstrip(":")
    return APIError(message, param=first if fields and first in fields else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(f"the body is not valid JSON{': ' + str(detail) if detail else ''}", code="invalid_json")
    locs = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    loc = locs[0]
    common = loc[: min(map(len, locs))]
    while any(other[: len(common)] != common for other in locs):
        common = common[:-1]
    if len(errors) > 1 and common and len(common) < len(loc):
        # A union (prompt: str | list[int] | ...): every branch failed; name the field, not the branch.
        forms = sorted({other[len(common)] for other in locs if len(other) > len(common)})
        param = ".".join(common)
        return APIError(f"{param}: invalid value; expected one of: {', '.join(forms)}", param=param)
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid body"))
    if first.get("type") == "missing" and not loc:
        message = "a JSON object body is required"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        status = exc.status_code if exc.status_code in (401, 404, 405) or exc.status_code >= 500 else 400
        err = APIError(str(exc.detail), status=status, code=code)
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(f"internal error: {type(exc).__name__}", status=500, type_="server_error"))
