"""/v1/completions and /v1/chat/completions: a request becomes (prompt x n) engine streams, answered as one JSON
body or as server-sent events. A client that disconnects aborts its requests, streaming or not (a non-streaming
request watches its connection while it waits), which frees their KV blocks at once; aborted requests are counted.
Tokenisation runs in a worker thread: a megabyte of prompt never stalls the event loop (other requests, /health)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine import QueueFullError
from ..engine.async_engine import EngineStoppedError, RequestStream
from . import protocol as P
from . import beams, tools
from .chat_render import check_readable, check_template, render_chat
from .errors import ApiError
from .metrics import ServerMetrics
from .state import CurrentState, ServerState

router = APIRouter()


# the JSON and SSE answers (the OpenAPI schema documents both; errors are OpenAI-shaped 4xx/5xx, app.py)
ANSWERS = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                 "description": "one JSON body, or server-sent events with stream: true"}}


@router.post("/v1/completions", responses=ANSWERS)
async def completions(body: P.CompletionRequest, state: CurrentState, request: Request):
    lora = _check_model(state, body.model)
    beams.check(body)
    tok = state.tokenizer
    prompts = await run_in_threadpool(_prompt_ids, tok, body.prompt, state.vocab_size)
    prompts = [body.read_prompt(p, state.max_seq_len) for p in prompts]  # truncate_prompt_tokens (vLLM's)
    echo = [await run_in_threadpool(tok.decode, p, skip_special_tokens=body.skip_special_tokens is not False)
            if body.echo else "" for p in prompts]
    if body.use_beam_search:
        return await beams.serve(state, body, prompts, body.max_tokens or 16, False, echo, request, lora)
    return await _serve(state, body, prompts, body.max_tokens or 16, body.logprobs, False, echo, request, lora=lora)


@router.post("/v1/chat/completions", responses=ANSWERS)
async def chat_completions(body: P.ChatCompletionRequest, state: CurrentState, request: Request):
    lora = _check_model(state, body.model)
    beams.check(body)
    check_template(state, body.chat_template, "use /v1/completions")
    check_readable(body.messages)
    if body.continue_final_message and (body.add_generation_prompt or body.messages[-1].role != "assistant"):
        raise ApiError(400, "continue_final_message continues the last message: it must be the assistant's, and "
                       "add_generation_prompt false", param="continue_final_message")
    calls = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_parser)
    if calls[0] is not None and body.continue_final_message:
        raise ApiError(400, "a tool call is a new assistant message: tool_choice cannot continue the last one",
                       param="tool_choice")
    ids = body.read_prompt(await render_chat(
        state, body.messages, body.add_generation_prompt, body.continue_final_message, P.tool_dicts(body.tools),
        body.chat_template, body.chat_template_kwargs), state.max_seq_len)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, state.max_seq_len - len(ids))
    if body.use_beam_search:
        if calls[0] is not None:
            raise ApiError(400, "tool calls are constrained answers, which a beam search does not take: ask with "
                           "tool_choice none or without use_beam_search", param="tool_choice")
        return await beams.serve(state, body, [ids], max_tokens, True, [""], request, lora)
    top = (body.top_logprobs or 0) if body.logprobs else None
    return await _serve(state, body, [ids], max_tokens, top, True, [""], request, calls, lora)


def _check_model(state: ServerState, name: str, base_only: str | None = None) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model), or a 404 naming the ids there are.
    ``base_only``: the route runs the base model alone (its name, for the 400 an adapter's id gets)."""
    if name == state.served_model_name:
        return None
    if name in state.lora_modules:
        if base_only is not None:
            raise ApiError(400, f"{base_only} runs the base model, without LoRA adapters: ask with model "
                           f"{state.served_model_name!r}", param="model")
        return name
    ids = ", ".join(map(repr, state.model_ids()))
    raise ApiError(404, f"model {name!r} does not exist; this server serves {ids}", "not_found_error", "model")


def _check_ids(prompts: list[list[int]], vocab_size: int, param: str = "prompt") -> None:
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"{param} token ids out of range [0, {vocab_size}): {bad[:5]}", param=param)


def _prompt_ids(tok, prompt, vocab_size: int, param: str = "prompt") -> list[list[int]]:
    """Token ids of each prompt (text tokenised; ids range-checked before anything decodes them)."""
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if prompt and isinstance(prompt[0], str):
        return [tok.encode(p) for p in prompt]
    prompts = [list(p) for p in prompt] if prompt and isinstance(prompt[0], list) else [list(prompt)]
    _check_ids(prompts, vocab_size, param)
    return prompts


async def _serve(state: ServerState, body, prompts, max_tokens, logprobs, chat, echo, request: Request,
                 calls: tuple = (None, None), lora: str | None = None):
    """``calls``: tools.plan's (mode, constraint) of a chat request; a mode answers with tool calls. ``lora``: the
    adapter the request's model id names (None: the base model)."""
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    # echo with logprobs scores the prompt too (OpenAI's legacy completions: its tokens lead the logprobs, the first
    # with none), as lm-evaluation-harness's loglikelihood requests read it
    scored = not chat and body.echo and logprobs is not None
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs are answered whole, not streamed: ask with stream false",
                       param="prompt_logprobs")
    # the engine scores the prompt with the alternatives both ask for; each answer keeps its own count
    asks = [n for n in (body.prompt_logprobs, logprobs if scored else None) if n is not None]
    prompt_top = max(asks) if asks else None
    try:
        structured, field = body.structured()
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(":")[0] if ":" in str(e) else "response_format")
    mode, constraint = calls
    if mode in ("named", "required"):
        if structured is not None:
            raise ApiError(400, f"tool_choice {mode!r} constrains the answer to a call already: give {field} or "
                           "tool_choice, not both", param="tool_choice")
        structured, field = constraint, "tools"
    streams: list[RequestStream] = []
    # a predicted output (OpenAI's): its tokens, a copy source for the suffix proposers' drafts
    prediction = None if body.prediction is None else await run_in_threadpool(
        state.tokenizer.encode, body.prediction.text(), add_special_tokens=False)
    kw = {} if body.speculation else {"speculate": False}
    if body.priority:
        kw["priority"] = body.priority
    if prediction:
        kw["prediction"] = prediction
    if lora is not None:
        kw["lora"] = lora
    try:
        for i, ids in enumerate(prompts):
            for j in range(body.n):
                streams.append(await add_stream(
                    state, ids, lambda: body.sampling_params(max_tokens, logprobs, seed_offset=j, structured=structured,
                                                             prompt_logprobs=prompt_top),
                    f"{rid}-{i}-{j}", field, **kw))
    except BaseException:
        for s in streams:
            s.close()
        raise
    name = body.tool_choice.function.name if mode == "named" else None
    choices = [_Choice(k, s, prompts[k // body.n], echo[k // body.n], scored,
                       None if mode is None else tools.ToolCallReader(mode, name, state.tool_parser))
               for k, s in enumerate(streams)]
    if body.stream:
        opts = body.stream_options
        events = _stream_events(state, rid, body.model, choices, chat, bool(opts and opts.include_usage), logprobs,
                                bool(opts and opts.include_spec),
                                bool(opts and opts.include_usage and opts.continuous_usage_stats))
        return StreamingResponse(events, media_type="text/event-stream")
    gone = await consume_all(state, choices, request)
    return gone or _final_body(state.tokenizer, rid, body.model, choices, chat, logprobs, state.speculative,
                               body.prompt_logprobs)


async def consume_all(state: ServerState, choices: list[_Choice], request: Request) -> Response | None:
    """Read every choice to its end while watching the client (``watched``). Whatever still runs is aborted on the
    way out."""
    try:
        return await watched(asyncio.ensure_future(asyncio.gather(*[c.consume(state.metrics) for c in choices])),
                             request)
    finally:
        _close(choices, state.metrics)


async def watched(work: asyncio.Future, request: Request) -> Response | None:
    """Await ``work`` while watching its client: None once it is done (its result read: an error it raised is raised
    here, an engine that died under it (a lost tensor-parallel worker) as an ApiError 503), a 499 if the client has
    gone first (nobody will read the answer: nginx's "client closed"; ``work`` is cancelled)."""
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        return Response(status_code=499)
    try:
        work.result()
    except EngineStoppedError as e:
        raise ApiError(503, str(e), "server_error") from e
    return None


async def add_stream(state: ServerState, ids: list[int], params, request_id: str, field: str | None = None,
                     **kw) -> RequestStream:
    """One engine request of ``params()`` (its SamplingParams, built here so that a bad value is a 400 too), or the
    ApiError that answers it: 503 when the engine cannot take it now, 400 naming what is wrong with it (``field``: the
    structured output's, for the grammar library's verdict). A rejection is counted."""
    try:
        return await state.engine.add_request(ids, params(), request_id, **kw)
    except EngineStoppedError as e:  # e.g. a lost tensor-parallel worker: nothing can run now
        state.metrics.requests.labels("rejected").inc()
        raise ApiError(503, str(e), "server_error")
    except QueueFullError as e:
        state.metrics.requests.labels("rejected").inc()
        raise ApiError(503, f"server busy: {e}", "server_error", headers={"Retry-After": "1"})
    except ValueError as e:
        state.metrics.requests.labels("rejected").inc()
        msg = str(e)
        if field is not None and msg.startswith("invalid "):  # the grammar library's verdict
            raise ApiError(400, f"{field}: {msg}", param=field)
        raise ApiError(400, msg, param=_param_of(msg))


DISCONNECT_POLL_S = 0.1  # how soon a non-streaming request notices that its client has gone


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _close(choices, metrics: ServerMetrics) -> None:
    """Abort whatever still runs (its KV is freed at once), counted as aborted requests."""
    for c in choices:
        if not c.stream.finished:
            metrics.requests.labels("abort").inc()
        c.stream.close()


async def _stream_events(state: ServerState, rid, model, choices, chat, include_usage, logprobs, include_spec=False,
                         continuous_usage=False):
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
                yield _sse(P.completion_chunk(rid, model, created, [  # a call's message has no content
                    {"index": c.index, "delta": {"role": "assistant", "content": None if c.reader else ""},
                     "finish_reason": None}], chat=True))
        elif any(c.echo for c in choices) and not any(c.scored for c in choices):
            for c in choices:
                yield _sse(P.completion_chunk(rid, model, created, [
                    {"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}]))
                c.offset = len(c.echo)
        open_ = len(choices)
        while open_:
            c, out = await merged.get()
            if out is None:
                open_ -= 1
                continue
            if isinstance(out, Exception):
                yield _sse(P.error_body(f"generation failed: {out}", "server_error", None, 500))
                continue
            finish = c.finish_reason if out.finished else None  # set by c.observe
            if c.scored and not c.echoed:  # the prompt's chunk, scored by the first output's
                c.echoed = True
                lp, c.offset = _prompt_payload(state.tokenizer, c.prompt_ids, out.prompt_logprobs, logprobs)
                yield _sse(P.completion_chunk(rid, model, created, [
                    {"index": c.index, "text": c.echo, "logprobs": lp, "finish_reason": None}]))
            if include_spec and out.token_id is not None:
                c.spec.append({"source": out.source, "k": out.round_k})
            if not out.text and finish is None and logprobs is None:
                continue  # nothing visible yet (text held back for a stop string or partial UTF-8)
            lp = None
            if logprobs is not None and out.token_id is not None:
                lp = _logprobs_payload(state.tokenizer, [out], chat, c.offset)
                c.offset += sum(len(t) for t in lp.get("tokens", ()))
            if chat:
                delta = c.reader.feed(out.text, out.finished) if c.reader else \
                    {"content": out.text} if out.text else {}
                if c.reader and finish is not None:  # the whole answer read: did it call?
                    finish = c.finish_reason = c.reader.finish_reason(finish)
                if not delta and finish is None and lp is None:
                    continue  # a call not complete yet
                choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": c.index, "text": out.text, "logprobs": lp, "finish_reason": finish}
            if include_spec:  # the tokens whose text this chunk carries (several when text was held back)
                choice["spec"], c.spec = {"tokens": c.spec}, []
            usage = _usage(choices, state.speculative) if continuous_usage else None  # the tokens so far
            yield _sse(P.completion_chunk(rid, model, created, [choice], usage, chat=chat))
        if include_usage:
            yield _sse(P.completion_chunk(rid, model, created, [], _usage(choices, state.speculative), chat=chat))
        yield "data: [DONE]\n\n"
    finally:  # normal end, client disconnect (cancellation) or error: abort whatever still runs
        for t in tasks:
            t.cancel()
        _close(choices, state.metrics)


class _Choice:
    """One (prompt, n) stream and what has been seen of it."""

    def __init__(self, index: int, stream: RequestStream, prompt_ids: list[int], echo: str, scored: bool = False,
                 reader: tools.ToolCallReader | None = None):
        self.index, self.stream, self.prompt_ids, self.echo = index, stream, prompt_ids, echo
        self.scored = scored  # the echoed prompt's tokens lead the logprobs (``_serve``)
        self.reader = reader  # a tool call's: the text read as calls
        self.outputs = []
        self.text = ""
        self.finish_reason = None
        self.draft = self.accepted = self.cached = 0
        self.spec: list[dict] = []  # stream_options.include_spec: tokens not yet sent in a chunk
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.last = None  # the latest StepOutput (the final one once the stream has ended)
        self.offset = 0  # characters of the choice's text before its next token (a streamed choice's text_offset)
        self.echoed = False  # the echoed prompt's chunk was sent (streamed with logprobs: at the first output)

    def observe(self, out, metrics: ServerMetrics) -> None:
        t = time.monotonic()
        self.last = out
        if out.token_id is not None:
            self.outputs.append(out)
            if self.t_last is None:
                self.t_first = t
                metrics.ttft.observe(t - self.t0)
            else:
                metrics.itl.observe(t - self.t_last)
            self.t_last = t
        self.text += out.text
        if out.finished:
            self.finish_reason = _finish_reason(out)
            self.draft, self.accepted = out.num_draft_tokens, out.num_accepted_tokens
            self.cached = out.num_cached_tokens
            metrics.requests.labels(out.finish_reason or "stop").inc()
            metrics.e2e.observe(t - self.t0)

    async def consume(self, metrics: ServerMetrics) -> None:
        async for out in self.stream:
            self.observe(out, metrics)


def _finish_reason(out) -> str:
    """OpenAI's "length" / "stop"; "abort" for a request the server stopped (shutdown past its grace period)."""
    return out.finish_reason if out.finish_reason in ("length", "abort") else "stop"


def _usage(choices: list[_Choice], speculative: bool) -> dict:
    seen_prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}  # n choices share one prompt
    cached: dict[int, int] = {}  # a prompt's: the fewest its choices found (a sibling's own prefill is no reuse)
    for c in choices:
        cached[id(c.prompt_ids)] = min(cached.get(id(c.prompt_ids), c.cached), c.cached)
    prompt = sum(seen_prompts.values())
    completion = sum(len(c.outputs) for c in choices)
    return P.usage(prompt, completion, sum(c.draft for c in choices), sum(c.accepted for c in choices), speculative,
                   sum(cached.values()))


def _token_strs(tok, ids) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def _completion_logprobs(tok, ids: list[int], scored: list, offset: int) -> tuple[dict, int]:
    """Legacy completions' logprobs of tokens ``ids``, each scored by (log p, [(token, log p) alternatives]) or None
    (a prompt's first token), the first starting ``offset`` characters into the choice's text -> (the payload, the
    offset after them)."""
    tokens = _token_strs(tok, ids)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = [None if s is None else dict(zip(_token_strs(tok, [i for i, _ in s[1] or []]), [lp for _, lp in s[1] or []]))
            for s in scored]
    return {"tokens": tokens, "token_logprobs": [None if s is None else s[0] for s in scored], "top_logprobs": tops,
            "text_offset": offsets}, offset


def _prompt_payload(tok, ids: list[int], scored, top: int) -> tuple[dict, int]:
    """The echoed prompt's logprobs with ``top`` alternatives (``scored``: StepOutput.prompt_logprobs, which may hold
    more for the request's prompt_logprobs; None: not computed, every entry None)."""
    scored = [None] * len(ids) if scored is None else [s if s is None else (s[0], s[1][:top]) for s in scored]
    return _completion_logprobs(tok, ids, scored, 0)


def _scored_prompt(c: _Choice) -> list | None:
    """The choice's prompt as scored by the engine (its first output carries it), or None (no output came)."""
    return c.outputs[0].prompt_logprobs if c.outputs else None


def _vllm_prompt_logprobs(tok, ids: list[int], scored: list | None, top: int) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}} of the
    token itself and its ``top`` alternatives (ranks 1..top in order)."""
    if scored is None:
        return None
    out = []
    for tid, s in zip(ids, scored):
        if s is None:
            out.append(None)
            continue
        own, alts, rank = s[0], s[1][:top], s[2]
        entry = {str(t): {"logprob": lp, "rank": r, "decoded_token": d}
                 for r, ((t, lp), d) in enumerate(zip(alts, _token_strs(tok, [t for t, _ in alts])), 1)}
        entry[str(tid)] = {"logprob": own, "rank": rank, "decoded_token": _token_strs(tok, [tid])[0]}
        out.append(entry)
    return out


def _logprobs_payload(tok, outs, chat: bool, offset: int = 0) -> dict:
    strs = lambda ids: _token_strs(tok, ids)  # noqa: E731
    if chat:
        content = []
        for o in outs:
            s = strs([o.token_id])[0]
            alts = [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                    for t, (_, lp) in zip(strs([i for i, _ in o.top_logprobs or []]), o.top_logprobs or [])]
            content.append({"token": s, "logprob": o.logprob, "bytes": list(s.encode()), "top_logprobs": alts})
        return {"content": content}
    return _completion_logprobs(tok, [o.token_id for o in outs], [(o.logprob, o.top_logprobs) for o in outs],
                                offset)[0]


def _final_body(tok, rid, model, choices: list[_Choice], chat: bool, logprobs, speculative: bool,
                prompt_logprobs: int | None = None) -> dict:
    """``prompt_logprobs``: vLLM's, with that many alternatives (a chat completion's one list, a completion choice's
    own), or None: not asked."""
    out_choices = []
    for c in choices:
        lp = None
        if logprobs is not None and chat:
            lp = _logprobs_payload(tok, c.outputs, chat)
        elif logprobs is not None:  # an echoed prompt's tokens first, scored (the first with none)
            head, offset = ({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0)
            if c.scored:
                head, offset = _prompt_payload(tok, c.prompt_ids, _scored_prompt(c), logprobs)
            tail = _logprobs_payload(tok, c.outputs, chat, offset)
            lp = {k: head[k] + tail[k] for k in head}
        if chat and c.reader is not None:  # read whole: the calls it makes
            c.reader.feed(c.text, final=True)
            c.finish_reason = c.reader.finish_reason(c.finish_reason)
            out_choices.append({"index": c.index, "message": c.reader.message(), "logprobs": lp,
                                "finish_reason": c.finish_reason})
        elif chat:
            out_choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            out_choices.append({"index": c.index, "text": c.echo + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})
            if prompt_logprobs is not None:
                out_choices[-1]["prompt_logprobs"] = _vllm_prompt_logprobs(tok, c.prompt_ids, _scored_prompt(c),
                                                                           prompt_logprobs)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": P.now(),
            "model": model, "choices": out_choices, "usage": _usage(choices, speculative)}
    if chat and prompt_logprobs is not None:  # the n choices share one prompt
        body["prompt_logprobs"] = _vllm_prompt_logprobs(tok, choices[0].prompt_ids, _scored_prompt(choices[0]),
                                                        prompt_logprobs)
    return body


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _param_of(message: str) -> str | None:
    """The field a validation message names (SamplingParams.<field> ..., or the prompt's length)."""
    if message.startswith("SamplingParams."):
        return message.split()[0].split(".", 1)[1]
    if message.startswith("priority"):
        return "priority"
    if "prompt" in message:
        return "prompt"
    return None
