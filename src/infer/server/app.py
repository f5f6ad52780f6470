"""The OpenAI-compatible HTTP server: a thin adapter from the wire format to AsyncEngine streams.

Errors are OpenAI-shaped JSON: 400 invalid parameter (names it) or a prompt that cannot fit (states the
lengths), 401 wrong key, 404 unknown model or route, 413 oversized body, 503 + Retry-After when the waiting queue
is full. The routes live in routers (meta, completions, responses, messages, tokens, embeddings, scores, adapters)
that read a ServerState from ``app.state.server``; errors and middlewares are in errors.py. ``/`` serves the playground
(static/: chat or completion, streamed, each token coloured by how speculation produced it).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from ..engine.async_engine import AsyncEngine
from ..pooling import PoolingParams
from . import adapters, completions, embeddings, llamacpp, messages, meta, responses, scores, tokens
from . import slots as slots_route  # build_app's ``slots`` is the flag
from .errors import ApiKeyAuth, BodySizeLimit, install_error_handlers
from .state import ServerState


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}
ERRORS = {"400": "invalid parameter or a prompt that cannot fit", "401": "wrong or missing API key",
          "404": "unknown model", "413": "request body too large", "503": "queue full (Retry-After) or engine down"}


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema with the errors this server sends: OpenAI-shaped 400 where FastAPI would document 422."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        names = app.state.server.model_ids()  # the model ids this server answers to (else 404)
        for body in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
            props = schema["components"]["schemas"].get(body, {}).get("properties", {})
            if "model" in props and not app.state.server.engine.lora_loading:  # else ids come and go
                props["model"] = {"type": "string", "enum": names, "title": "Model"}
        ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        for path, ops in schema["paths"].items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                # a route without a body can still name something unknown in its path (/v1/models/{model}: 404)
                bodyless = ("401", "503", "404") if "{" in path else ("401", "503")
                codes = ERRORS if op.get("requestBody") else {k: v for k, v in ERRORS.items() if k in bodyless}
                for code, text in codes.items():
                    if path == "/health" and code == "401":  # liveness stays open
                        continue
                    responses.setdefault(code, {"description": text, "content": ref})
        schema["components"]["schemas"].pop("HTTPValidationError", None)
        schema["components"]["schemas"].pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema


class ReplicaHeader:
    """ASGI middleware: every response says which replica served it (``x-infer-replica``; server/replicas.py)."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (b"x-infer-replica", replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_tagged)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    if tasks := app.state.server.responses.cancel_all():  # background responses still running: stopped, not lost
        await asyncio.wait(tasks)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20, replica: str | None = None, tool_parser: str | None = None,
              chat_template: str | None = None, trust_request_chat_template: bool = False,
              pooling: str = "last", slots: bool = True) -> FastAPI:
    """``tool_parser`` (tools.PARSERS): the model's call format, which tool_choice "auto" needs; ValueError if the
    chat template does not show the model its tools (it could not call them). ``chat_template``: a Jinja template
    the server renders chats with instead of the checkpoint's (vLLM's ``--chat-template``); ValueError if it cannot
    render a conversation. ``trust_request_chat_template``: a request's own ``chat_template`` is rendered, not
    refused (vLLM's ``--trust-request-chat-template``). ``pooling``: how ``/v1/embeddings`` pools an input's states
    (infer.pooling: "last" or "mean", llama.cpp's ``--pooling``); ValueError for another. ``slots``: ``GET /slots``
    answers (llama-server's; ``--no-slots``: 501)."""
    PoolingParams(pooling)  # a pooling it does not know, named before anything is served
    if chat_template is not None:
        engine.engine.tokenizer.use_chat_template(chat_template)
    if tool_parser is not None:
        from .tools import PARSERS

        if tool_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {tool_parser!r}")
        if not engine.engine.tokenizer.shows_tools():
            raise ValueError("--tool-call-parser: this checkpoint's chat template does not show tools to the model, "
                             "so it cannot choose to call one; tool_choice 'required' or a named function works "
                             "without a parser")
    app = FastAPI(title="infer", docs_url=None, redoc_url=None, lifespan=_lifespan)
    app.openapi = lambda: openapi_schema(app)
    app.state.server = ServerState.from_engine(engine, served_model_name, tool_parser, trust_request_chat_template,
                                                pooling, slots)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(BodySizeLimit, limit=max_body_bytes)  # outside auth and the routes: it refuses first
    if replica is not None:
        app.add_middleware(ReplicaHeader, replica=replica)
    app.include_router(meta.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(tokens.router)
    app.include_router(embeddings.router)
    app.include_router(scores.router)
    app.include_router(adapters.router)
    app.include_router(messages.router)
    app.include_router(llamacpp.router)
    app.include_router(slots_route.router)
    # the playground: plain HTML, CSS and a JS module, no build step (static/)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_api_route("/", lambda: FileResponse(STATIC / "index.html"), include_in_schema=False)
    return app


STATIC = Path(__file__).parent / "static"
