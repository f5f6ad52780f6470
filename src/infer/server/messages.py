"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), as llama.cpp's and vLLM's servers
answer it, so that a client written for it (the ``anthropic`` SDK) talks to infer: ``system`` and ``messages`` (text,
or text blocks) become chat messages for the checkpoint's template, ``max_tokens`` / ``stop_sequences`` /
``temperature`` / ``top_p`` / ``top_k`` the request's sampling, and the answer is a ``message`` whose ``content`` holds
one text block, with Anthropic's ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``) and ``usage``; or,
streamed, its events (``message_start``, ``content_block_start``, ``content_block_delta`` ..., ``message_delta``,
``message_stop``). The same engine requests as chat, so speculation stays exact. What the model here cannot do is
refused by name: images and documents, tools (the OpenAI routes serve tool calling), extended thinking, structured
output (``output_config``). ``temperature`` defaults to Anthropic's 1.0 (its SDK 2.x no longer sends the field; a
raw request can)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, field_validator

from ..sampling import SamplingParams
from . import protocol as P
from .chat_render import render_chat
from .completions import ANSWERS, _check_model, add_stream, watched
from .errors import ApiError
from .state import CurrentState

router = APIRouter()


class Block(BaseModel):
    model_config = P.STRICT

    type: str
    text: str | None = None

    _valid = field_validator("text")(P.valid_text)


class Message(BaseModel):
    model_config = P.STRICT

    role: Literal["user", "assistant"]
    content: str | list[Block]

    _valid = field_validator("content")(P.valid_text)


class CountTokensRequest(BaseModel):
    """The conversation (``/v1/messages/count_tokens`` takes it alone)."""

    model_config = P.STRICT

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    # what this server does not do: refused by name when asked for, never dropped in silence
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None

    _valid = field_validator("system")(P.valid_text)
    _no_tools = field_validator("tools", "tool_choice")(P._unsupported(
        "no tool use on /v1/messages: /v1/chat/completions and /v1/responses serve tool calling"))
    _no_thinking = field_validator("thinking")(P._unsupported("this model does not reason apart from its answer"))
    _no_output_config = field_validator("output_config")(P._unsupported(
        "no structured output on /v1/messages: /v1/chat/completions' response_format serves it"))


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None  # Anthropic's user_id: not read


def _text(content: str | list[Block], param: str) -> str:
    if isinstance(content, str):
        return content
    odd = next((b.type for b in content if b.type != "text"), None)
    if odd is not None:
        raise ApiError(400, f"{param}: this model reads text only, not {odd!r} blocks", param=param)
    return "".join(b.text or "" for b in content)


def _chat(body: CountTokensRequest) -> list[P.ChatMessage]:
    """The request as chat messages: the system prompt first, then each turn's text."""
    out = [P.ChatMessage(role="system", content=_text(body.system, "system"))] if body.system else []
    out += [P.ChatMessage(role=m.role, content=_text(m.content, f"messages[{i}].content"))
            for i, m in enumerate(body.messages)]
    return out


def _params(body: MessagesRequest, max_tokens: int) -> SamplingParams:
    # Anthropic's default temperature is 1.0
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                          max_tokens=max_tokens, stop=body.stop_sequences or None)


def _stop(out) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a final StepOutput."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: CurrentState):
    _check_model(state, body.model)
    return {"input_tokens": len(await render_chat(state, _chat(body)))}


@router.post("/v1/messages", responses=ANSWERS)
async def messages(body: MessagesRequest, request: Request, state: CurrentState):
    lora = _check_model(state, body.model)
    ids = await render_chat(state, _chat(body))
    room = state.max_seq_len - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) fills the context ({state.max_seq_len} tokens)",
                       param="messages")
    # Anthropic's clients ask for budgets of thousands of tokens: the answer stops where the context ends
    # (stop_reason max_tokens), as llama.cpp's server stops, instead of a refusal
    rid = P.new_id("msg")
    stream = await add_stream(state, ids, lambda: _params(body, min(body.max_tokens, room)), rid,
                              **({"lora": lora} if lora else {}))
    head = {"id": rid, "type": "message", "role": "assistant", "model": body.model}
    if body.stream:
        return StreamingResponse(_events(state, stream, head, len(ids)), media_type="text/event-stream")
    parts, last = [], None

    async def read():
        nonlocal last
        async for out in stream:
            parts.append(out)
            last = out

    try:
        gone = await watched(asyncio.ensure_future(read()), request)
    finally:
        stream.close()
    if gone is not None:
        return gone
    reason, seq = _stop(last)
    state.metrics.requests.labels(last.finish_reason or "stop").inc()
    return {**head, "content": [{"type": "text", "text": "".join(o.text for o in parts)}], "stop_reason": reason,
            "stop_sequence": seq, "usage": _usage(len(ids), parts, last)}


def _usage(prompt: int, outs: list, last) -> dict:
    return {"input_tokens": prompt, "output_tokens": sum(o.token_id is not None for o in outs),
            "cache_read_input_tokens": last.num_cached_tokens if last is not None else 0}


async def _events(state, stream, head: dict, prompt: int):
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    outs, last = [], None
    yield event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": {"input_tokens": prompt, "output_tokens": 0}}})
    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    try:
        async for out in stream:
            outs.append(out)
            last = out
            if out.text:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": out.text}})
    except Exception as e:  # noqa: BLE001 - the stream has begun: an error event, as Anthropic's API sends one
        yield event("error", {"error": {"type": "api_error", "message": str(e)}})
        return
    finally:
        stream.close()
    yield event("content_block_stop", {"index": 0})
    reason, seq = _stop(last)
    state.metrics.requests.labels(last.finish_reason or "stop").inc()
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                  "usage": {"output_tokens": _usage(prompt, outs, last)["output_tokens"]}})
    yield event("message_stop", {})
