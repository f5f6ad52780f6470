"""The OpenAI-compatible HTTP server: a thin adapter from the wire format to AsyncEngine streams.

Errors are OpenAI-shaped JSON: 400 invalid parameter (names it) or a prompt that cannot fit (states the
lengths), 401 wrong key, 404 unknown model or route, 413 oversized body, 503 + Retry-After when the waiting queue
is full. The routes live in routers (meta, completions) that read a ServerState from ``app.state.server``; errors
and middlewares are in errors.py.
"""

from __future__ import annotations

from fastapi import FastAPI

from ..engine.async_engine import AsyncEngine
from . import completions, meta
from .errors import ApiKeyAuth, BodySizeLimit, install_error_handlers
from .state import ServerState


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI(title="infer", docs_url=None, redoc_url=None)
    app.state.server = ServerState.from_engine(engine, served_model_name)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(BodySizeLimit, limit=max_body_bytes)  # added last: outermost, so it refuses first
    app.include_router(meta.router)
    app.include_router(completions.router)
    return app
