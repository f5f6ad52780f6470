"""OpenAI-shaped errors: the exception routes raise, the handlers that turn every failure into error JSON, and the
two middlewares that refuse a request before any route sees it (an oversized body, a wrong API key)."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def error_response(status: int, message: str, type_: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type_, param, status), status_code=status, headers=headers)


async def _api_error(_, e: ApiError):
    return error_response(e.status, e.message, e.type, e.param, e.headers)


async def _validation(request, e: RequestValidationError):
    err = e.errors()[0] if e.errors() else {}
    if err.get("type") == "json_invalid":  # loc ("body", offset): the offset is no parameter
        why = (err.get("ctx") or {}).get("error", "")
        return error_response(400, f"the request body is not valid JSON{': ' + why if why else ''}",
                              "invalid_request_error")
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
    param = ".".join(loc) or None
    if param is None:
        kind = request.headers.get("content-type", "")
        if "json" not in kind.lower():  # e.g. `curl -d '{...}'` without a header: the body was not read as JSON
            return error_response(400, "the request body must be a JSON object sent with Content-Type: "
                                  f"application/json (this request's: {kind or 'none'!r})", "invalid_request_error")
        return error_response(400, f"invalid request body: {err.get('msg', 'invalid')} (a JSON object is expected)",
                              "invalid_request_error")
    return error_response(400, f"invalid parameter {param}: {err.get('msg', 'invalid')}", "invalid_request_error",
                          param)


async def _http(_, e: StarletteHTTPException):
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(e.status_code, str(e.detail), type_, headers=e.headers)  # 405 keeps its Allow header


async def _internal(_, e: Exception):  # a bug must answer as JSON, never take the server down
    return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)


def _open(path: str) -> bool:
    """Routes without a key: liveness probes, and the playground's page (it asks for the key itself)."""
    return path in ("/health", "/") or path.startswith("/static/")


class ApiKeyAuth:
    """ASGI middleware: 401 unless the request carries ``Authorization: Bearer <api_key>`` (or Anthropic's
    ``x-api-key: <api_key>``, as its SDK sends it); /health and the playground's static page stay open. Plain ASGI,
    not BaseHTTPMiddleware: that one wraps ``receive`` in a task group, where a route's ``request.is_disconnected()``
    poll never sees the client leave."""

    def __init__(self, app, api_key: str):
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
        if scope["type"] != "http" or _open(scope["path"]) or headers.get(b"authorization", b"") == self.expected \
                or headers.get(b"x-api-key", b"") == self.key:
            return await self.app(scope, receive, send)
        body = json.dumps(P.error_body("invalid or missing API key (Authorization: Bearer ...)",
                                       "authentication_error", None, 401)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes, by Content-Length or by counting a chunked body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send):
        body = json.dumps(P.error_body(f"request body exceeds {self.limit} bytes", "invalid_request_error",
                                       None, 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
