"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), as llama.cpp's and vLLM's servers
answer it, so that a client written for it (the ``anthropic`` SDK) talks to infer: ``system`` and ``messages`` (text,
text blocks, and a tool's history: ``tool_use`` and ``tool_result`` blocks) become chat messages for the checkpoint's
template, ``max_tokens`` / ``stop_sequences`` / ``temperature`` / ``top_p`` / ``top_k`` the request's sampling, and
the answer is a ``message`` whose ``content`` holds text and ``tool_use`` blocks, with Anthropic's ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and ``usage``; or, streamed, its events
(``message_start``, ``content_block_start``, ``content_block_delta`` ..., ``message_delta``, ``message_stop``).
A last message of the assistant's is continued (Anthropic's prefill), not answered. Custom ``tools`` and
``tool_choice`` are tool calling as the OpenAI routes serve it (message_blocks.py, tools.py): ``any`` and ``tool`` are
calls constrained by the tools' ``input_schema``, ``auto`` needs ``infer serve --tool-call-parser``;
``output_config.format`` (a JSON schema) is structured output. Both stay exact under speculation, as the same engine
requests as chat do. What the model here cannot do is refused by name: images and documents, server tools, extended
thinking and ``effort``. ``temperature`` defaults to Anthropic's 1.0 (its SDK 2.x no longer sends the field; a raw
request can)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, field_validator

from ..sampling import SamplingParams
from ..structured import StructuredOutput
from . import protocol as P
from . import tools
from .chat_render import render_chat
from .completions import ANSWERS, _check_model, add_stream, watched
from .errors import ApiError
from .message_blocks import Blocks, chat_messages, chat_tools, openai_choice
from .state import CurrentState

router = APIRouter()


class Block(BaseModel):
    """A content block: text; an assistant's tool_use (id, name, input); a user's tool_result (tool_use_id, content:
    text or text blocks). Anthropic's cache_control, citations and the like are read past (this server caches
    prompts' K/V by itself)."""

    model_config = P.STRICT

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False

    _valid = field_validator("text", "content")(P.valid_text)


class Message(BaseModel):
    model_config = P.STRICT

    role: Literal["user", "assistant"]
    content: str | list[Block]

    _valid = field_validator("content")(P.valid_text)


class ToolDef(BaseModel):
    """A custom tool (``type`` absent or "custom"); a server tool's type is refused by name."""

    model_config = P.STRICT

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = P.STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(BaseModel):
    model_config = P.STRICT

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = P.STRICT

    format: OutputFormat | None = None
    effort: str | None = None

    _no_effort = field_validator("effort")(P._unsupported("this model does not reason apart from its answer"))


class CountTokensRequest(BaseModel):
    """The conversation (``/v1/messages/count_tokens`` takes it alone)."""

    model_config = P.STRICT

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    # what this server does not do: refused by name when asked for, never dropped in silence
    thinking: dict | None = None

    _valid = field_validator("system")(P.valid_text)
    _no_thinking = field_validator("thinking")(P._unsupported("this model does not reason apart from its answer",
                                                              off=(None, {}, {"type": "disabled"})))


class MessagesRequest(CountTokensRequest):
    max_tokens: int | None = Field(None, ge=1)  # Anthropic's clients send it; llama.cpp's server has it optional
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict | None = None  # Anthropic's user_id: not read


def _text(content: str | list[Block], param: str) -> str:
    if isinstance(content, str):
        return content
    odd = next((b.type for b in content if b.type != "text"), None)
    if odd is not None:
        raise ApiError(400, f"{param}: this model reads text only, not {odd!r} blocks", param=param)
    return "".join(b.text or "" for b in content)


class _Plan:
    """What a request asks of the engine: its chat (the last assistant message continued, if it ends the
    conversation), the template's tools, the tool mode (tools.plan's) and the answer's constraint. ``answer``
    False: the prompt alone (count_tokens: how the answer would be read does not change it)."""

    def __init__(self, body: CountTokensRequest, parser: str | None, answer: bool = True):
        system = _text(body.system, "system") if body.system else None
        self.chat = chat_messages(system, body.messages, _text)
        self.tools = chat_tools(body.tools)
        choice, parallel = openai_choice(body.tool_choice, self.tools, parser) if answer else ("none", True)
        self.mode, self.structured = tools.plan(self.tools, choice, parallel, parser)
        self.field = "tools"
        self.name = choice.function.name if self.mode == "named" else None
        last = body.messages[-1]
        self.prefill = last.role == "assistant"
        if self.prefill and (self.chat[-1].tool_calls or self.mode in ("named", "required")):
            raise ApiError(400, "a last assistant message is continued (a prefill): it cannot hold tool_use blocks, "
                           "nor be continued as a tool call (tool_choice 'any' or 'tool')", param="messages")
        fmt = getattr(getattr(body, "output_config", None), "format", None)
        if fmt is not None:
            if self.structured is not None:
                raise ApiError(400, f"tool_choice {body.tool_choice.type!r} constrains the answer to a call already: "
                               "give output_config.format or tool_choice, not both", param="tool_choice")
            self.structured, self.field = StructuredOutput(json_schema=fmt.schema_), "output_config"

    async def prompt(self, state) -> list[int]:
        return await render_chat(state, self.chat, add_generation_prompt=not self.prefill,
                                 continue_final_message=self.prefill, tools=P.tool_dicts(self.tools))


def _params(body: MessagesRequest, max_tokens: int, structured) -> SamplingParams:
    # Anthropic's default temperature is 1.0
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                          max_tokens=max_tokens, stop=body.stop_sequences or None, structured=structured)


def _stop(out, calls: int) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a final StepOutput (``calls``: the tool_use blocks answered)."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return ("tool_use" if calls else "end_turn"), None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: CurrentState):
    _check_model(state, body.model)
    return {"input_tokens": len(await _Plan(body, state.tool_parser, answer=False).prompt(state))}


@router.post("/v1/messages", responses=ANSWERS)
async def messages(body: MessagesRequest, request: Request, state: CurrentState):
    lora = _check_model(state, body.model)
    plan = _Plan(body, state.tool_parser)
    ids = await plan.prompt(state)
    room = state.max_seq_len - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) fills the context ({state.max_seq_len} tokens)",
                       param="messages")
    # Anthropic's clients ask for budgets of thousands of tokens: the answer stops where the context ends
    # (stop_reason max_tokens), as llama.cpp's server stops, instead of a refusal; no budget: the context's room
    rid = P.new_id("msg")
    budget = min(body.max_tokens or room, room)
    stream = await add_stream(state, ids, lambda: _params(body, budget, plan.structured), rid,
                              plan.field if plan.structured is not None else None, **({"lora": lora} if lora else {}))
    reader = None if plan.mode is None else tools.ToolCallReader(plan.mode, plan.name, state.tool_parser)
    head = {"id": rid, "type": "message", "role": "assistant", "model": body.model}
    if body.stream:
        return StreamingResponse(_events(state, stream, head, len(ids), reader), media_type="text/event-stream")
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
    blocks = Blocks()
    text = "".join(o.text for o in parts)
    blocks.add(reader.feed(text, final=True) if reader else {"content": text})
    content = blocks.content()
    reason, seq = _stop(last, sum(b["type"] == "tool_use" for b in content))
    state.metrics.requests.labels(last.finish_reason or "stop").inc()
    return {**head, "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(len(ids), parts, last)}


def _usage(prompt: int, outs: list, last) -> dict:
    return {"input_tokens": prompt, "output_tokens": sum(o.token_id is not None for o in outs),
            "cache_read_input_tokens": last.num_cached_tokens if last is not None else 0}


async def _events(state, stream, head: dict, prompt: int, reader):
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    outs, last, blocks = [], None, Blocks()
    yield event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": {"input_tokens": prompt, "output_tokens": 0}}})
    try:
        async for out in stream:
            outs.append(out)
            last = out
            if out.text or (reader and out.finished):
                delta = reader.feed(out.text, out.finished) if reader else {"content": out.text}
                for kind, data in blocks.add(delta):
                    yield event(kind, data)
    except Exception as e:  # noqa: BLE001 - the stream has begun: an error event, as Anthropic's API sends one
        yield event("error", {"error": {"type": "api_error", "message": str(e)}})
        return
    finally:
        stream.close()
    for kind, data in blocks.close():
        yield event(kind, data)
    # a cut call counts as none (the whole answer gives its text), as content() reads it
    reason, seq = _stop(last, sum(b["type"] == "tool_use" for b in blocks.content()))
    state.metrics.requests.labels(last.finish_reason or "stop").inc()
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                  "usage": {"output_tokens": _usage(prompt, outs, last)["output_tokens"]}})
    yield event("message_stop", {})
