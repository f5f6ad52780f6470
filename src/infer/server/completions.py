"""/v1/completions and /v1/chat/completions: a request becomes (prompt x n) engine streams, answered as one JSON
body or as server-sent events. A client that disconnects mid-stream aborts its requests, which frees their KV
blocks at once."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from ..engine import QueueFullError
from ..engine.async_engine import RequestStream
from . import protocol as P
from .errors import ApiError
from .metrics import ServerMetrics
from .state import CurrentState, ServerState

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: P.CompletionRequest, state: CurrentState):
    _check_model(state, body.model)
    tok = state.tokenizer
    prompts = _prompt_ids(tok, body.prompt)
    echo = [tok.decode(p, skip_special_tokens=True) if body.echo else "" for p in prompts]
    return await _serve(state, body, prompts, body.max_tokens or 16, body.logprobs, chat=False, echo=echo)


@router.post("/v1/chat/completions")
async def chat_completions(body: P.ChatCompletionRequest, state: CurrentState):
    _check_model(state, body.model)
    tok = state.tokenizer
    if not tok.has_chat_template:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    ids = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, state.max_seq_len - len(ids))
    top = (body.top_logprobs or 0) if body.logprobs else None
    return await _serve(state, body, [ids], max_tokens, top, chat=True, echo=[""])


def _check_model(state: ServerState, name: str) -> None:
    if name != state.served_model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {state.served_model_name!r}",
                       "not_found_error", "model")


def _prompt_ids(tok, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if prompt and isinstance(prompt[0], str):
        return [tok.encode(p) for p in prompt]
    if prompt and isinstance(prompt[0], list):
        return [list(p) for p in prompt]
    return [list(prompt)]


async def _serve(state: ServerState, body, prompts, max_tokens, logprobs, chat, echo):
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            for j in range(body.n):
                try:
                    params = body.sampling_params(max_tokens, logprobs, seed_offset=j)
                    streams.append(await state.engine.add_request(ids, params, f"{rid}-{i}-{j}"))
                except QueueFullError as e:
                    state.metrics.requests.labels("rejected").inc()
                    raise ApiError(503, f"server busy: {e}", "server_error", headers={"Retry-After": "1"})
                except ValueError as e:
                    state.metrics.requests.labels("rejected").inc()
                    raise ApiError(400, str(e), param=_param_of(str(e)))
    except BaseException:
        for s in streams:
            s.close()
        raise
    choices = [_Choice(k, s, prompts[k // body.n], echo[k // body.n]) for k, s in enumerate(streams)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream_events(state, rid, body.model, choices, chat, include_usage, logprobs),
                                 media_type="text/event-stream")
    try:
        await asyncio.gather(*[c.consume(state.metrics) for c in choices])
    finally:
        for c in choices:
            c.stream.close()
    return _final_body(state.tokenizer, rid, body.model, choices, chat, logprobs, state.speculative)


async def _stream_events(state: ServerState, rid, model, choices, chat, include_usage, logprobs):
    created = P.now()
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice):
        try:
            async for out in c.stream:
                c.observe(out, state.metrics)
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
            lp = (_logprobs_payload(state.tokenizer, [out], chat)
                  if logprobs is not None and out.token_id is not None else None)
            if chat:
                choice = {"index": c.index, "delta": {"content": out.text} if out.text else {}, "logprobs": lp,
                          "finish_reason": finish}
            else:
                choice = {"index": c.index, "text": out.text, "logprobs": lp, "finish_reason": finish}
            yield _sse(P.completion_chunk(rid, model, created, [choice], chat=chat))
        if include_usage:
            yield _sse(P.completion_chunk(rid, model, created, [], _usage(choices, state.speculative), chat=chat))
        yield "data: [DONE]\n\n"
    finally:  # normal end, client disconnect (cancellation) or error: abort whatever still runs
        for t in tasks:
            t.cancel()
        for c in choices:
            c.stream.close()


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
