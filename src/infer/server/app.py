"""The OpenAI-compatible HTTP server: a thin adapter from the wire format to AsyncEngine streams.

Errors are OpenAI-shaped JSON: 400 invalid parameter (names it) or a prompt that cannot fit (states the
lengths), 401 wrong key, 404 unknown model or route, 413 oversized body, 503 + Retry-After when the waiting queue
is full. A client that disconnects mid-stream aborts its requests, which frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import QueueFullError
from ..engine.async_engine import AsyncEngine, RequestStream
from . import protocol as P
from .metrics import ServerMetrics


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _error(status: int, message: str, type_: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type_, param, status), status_code=status, headers=headers)


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


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI(title="infer", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine)
    tok = engine.engine.tokenizer
    speculative = engine.engine.draft_model is not None
    max_seq_len = engine.engine.max_seq_len
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return _error(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        param = ".".join(loc) or None
        return _error(400, f"invalid parameter {param}: {err.get('msg', 'invalid')}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), type_)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):  # a bug must answer as JSON, never take the server down
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return _error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        return await call_next(request)

    app.add_middleware(BodySizeLimit, limit=max_body_bytes)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return _error(503, f"engine loop stopped: {engine.error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": P.now(),
                                            "owned_by": "infer"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {served_model_name!r}",
                           "not_found_error", "model")

    def prompt_ids(prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [tok.encode(prompt)]
        if prompt and isinstance(prompt[0], str):
            return [tok.encode(p) for p in prompt]
        if prompt and isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        return [list(prompt)]

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        check_model(body.model)
        prompts = prompt_ids(body.prompt)
        echo = [tok.decode(p, skip_special_tokens=True) if body.echo else "" for p in prompts]
        return await serve(body, prompts, body.max_tokens or 16, body.logprobs, chat=False, echo=echo,
                           request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        check_model(body.model)
        if not tok.has_chat_template:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        ids = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, max_seq_len - len(ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await serve(body, [ids], max_tokens, top, chat=True, echo=[""], request=request)

    async def serve(body, prompts, max_tokens, logprobs, chat, echo, request):
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                for j in range(body.n):
                    try:
                        params = body.sampling_params(max_tokens, logprobs, seed_offset=j)
                        streams.append(await engine.add_request(ids, params, f"{rid}-{i}-{j}"))
                    except QueueFullError as e:
                        metrics.requests.labels("rejected").inc()
                        raise ApiError(503, f"server busy: {e}", "server_error", headers={"Retry-After": "1"})
                    except ValueError as e:
                        metrics.requests.labels("rejected").inc()
                        raise ApiError(400, str(e), param=_param_of(str(e)))
        except BaseException:
            for s in streams:
                s.close()
            raise
        choices = [_Choice(k, s, prompts[k // body.n], echo[k // body.n]) for k, s in enumerate(streams)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_events(rid, body.model, choices, chat, include_usage, logprobs),
                                     media_type="text/event-stream")
        try:
            await asyncio.gather(*[c.consume(metrics) for c in choices])
        finally:
            for c in choices:
                c.stream.close()
        return _final_body(tok, rid, body.model, choices, chat, logprobs, speculative)

    async def stream_events(rid, model, choices, chat, include_usage, logprobs):
        created = P.now()
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice):
            try:
                async for out in c.stream:
                    c.observe(out, metrics)
                    await merged.put((c, out))
            except Exception as e:  # noqa: BLE001 - surfaced to the client as an error event
                await merged.put((c, e))
            await merged.put((c, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            if chat:
                for c in choices:
                    yield _sse(P.completion_chunk(rid, model, created, [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                        chat=True))
            elif any(c.echo for c in choices):
                for c in choices:
                    yield _sse(P.completion_chunk(rid, model, created, [
                        {"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}]))
            open_ = len(choices)
            while open_:
                c, out = await merged.get()
                if out is None:
                    open_ -= 1
                    continue
                if isinstance(out, Exception):
                    yield _sse(P.error_body(f"generation failed: {out}", "server_error", None, 500))
                    continue
                finish = _finish_reason(out) if out.finished else None
                if not out.text and finish is None and logprobs is None:
                    continue  # nothing visible yet (text held back for a stop string or partial UTF-8)
                lp = _logprobs_payload(tok, [out], chat) if logprobs is not None and out.token_id is not None else None
                if chat:
                    choice = {"index": c.index, "delta": {"content": out.text} if out.text else {}, "logprobs": lp,
                              "finish_reason": finish}
                else:
                    choice = {"index": c.index, "text": out.text, "logprobs": lp, "finish_reason": finish}
                yield _sse(P.completion_chunk(rid, model, created, [choice], chat=chat))
            if include_usage:
                yield _sse(P.completion_chunk(rid, model, created, [], _usage(choices, speculative), chat=chat))
            yield "data: [DONE]\n\n"
        finally:  # normal end, client disconnect (cancellation) or error: abort whatever still runs
            for t in tasks:
                t.cancel()
            for c in choices:
                c.stream.close()

    return app


class _Choice:
    """One (prompt, n) stream and what has been seen of it."""

    def __init__(self, index: int, stream: RequestStream, prompt_ids: list[int], echo: str):
        self.index, self.stream, self.prompt_ids, self.echo = index, stream, prompt_ids, echo
        self.outputs = []
        self.text = ""
        self.finish_reason = None
        self.draft = self.accepted = 0
        self.t0 = time.monotonic()
        self.t_last: float | None = None

    def observe(self, out, metrics: ServerMetrics) -> None:
        t = time.monotonic()
        if out.token_id is not None:
            self.outputs.append(out)
            if self.t_last is None:
                metrics.ttft.observe(t - self.t0)
            else:
                metrics.itl.observe(t - self.t_last)
            self.t_last = t
        self.text += out.text
        if out.finished:
            self.finish_reason = _finish_reason(out)
            self.draft, self.accepted = out.num_draft_tokens, out.num_accepted_tokens
            metrics.requests.labels(out.finish_reason or "stop").inc()
            metrics.e2e.observe(t - self.t0)

    async def consume(self, metrics: ServerMetrics) -> None:
        async for out in self.stream:
            self.observe(out, metrics)


def _finish_reason(out) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def _usage(choices: list[_Choice], speculative: bool) -> dict:
    seen_prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}  # n choices share one prompt
    prompt = sum(seen_prompts.values())
    completion = sum(len(c.outputs) for c in choices)
    return P.usage(prompt, completion, sum(c.draft for c in choices), sum(c.accepted for c in choices), speculative)


def _logprobs_payload(tok, outs, chat: bool) -> dict:
    strs = lambda ids: [tok.decode([i], skip_special_tokens=False) for i in ids]  # noqa: E731
    if chat:
        content = []
        for o in outs:
            s = strs([o.token_id])[0]
            alts = [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, (_, lp) in zip(strs([i for i, _ in o.top_logprobs or []]), o.top_logprobs or [])]
            content.append({"token": s, "logprob": o.logprob, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content}
    tokens = strs([o.token_id for o in outs])
    tops = [{t: lp for t, (_, lp) in zip(strs([i for i, _ in o.top_logprobs or []]), o.top_logprobs or [])}
            for o in outs]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [o.logprob for o in outs], "top_logprobs": tops,
            "text_offset": offsets}


def _final_body(tok, rid, model, choices: list[_Choice], chat: bool, logprobs, speculative: bool) -> dict:
    out_choices = []
    for c in choices:
        lp = _logprobs_payload(tok, c.outputs, chat) if logprobs is not None else None
        if chat:
            out_choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            out_choices.append({"index": c.index, "text": c.echo + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": P.now(),
            "model": model, "choices": out_choices, "usage": _usage(choices, speculative)}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _param_of(message: str) -> str | None:
    """The field a validation message names (SamplingParams.<field> ..., or the prompt's length)."""
    if message.startswith("SamplingParams."):
        return message.split()[0].split(".", 1)[1]
    if "prompt" in message:
        return "prompt"
    return None
