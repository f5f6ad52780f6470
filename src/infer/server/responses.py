"""/v1/responses: OpenAI's Responses API over the same engine requests as chat. ``input`` (a string, or items:
messages, the model's ``function_call``s and their ``function_call_output``s) and ``instructions`` become chat
messages for the checkpoint's template; ``text.format`` is structured output and ``tools`` / ``tool_choice`` are
tool calling (tools.py), so both stay exact under speculation. The answer is a ``response`` object whose ``output``
holds a message item (``output_text``) and one ``function_call`` item per call, or, streamed, OpenAI's typed events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``). With ``store`` (OpenAI's
default) the answer is kept (response_store.py): ``previous_response_id`` continues its conversation, and
``GET`` / ``DELETE /v1/responses/{id}`` read and drop it (``GET .../input_items``: its own input). ``background``
runs the answer apart from its request (background.py: polled, streamed again from any event, cancelled).
``truncation`` "auto" drops the conversation's oldest turns (never the instructions, the leading system messages or
the last turn) until the prompt and ``max_output_tokens`` fit the context."""

from __future__ import annotations

import uuid
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling import MAX_LOGPROBS, SamplingParams
from ..structured import StructuredOutput
from . import protocol as P
from . import tools
from .background import Job
from .chat_render import render_chat
from .completions import ANSWERS, _Choice, _check_model, add_stream, consume_all
from .errors import ApiError
from .response_items import Answer
from .response_store import Stored, answer_messages
from .state import CurrentState

router = APIRouter()
LOGPROBS = "message.output_text.logprobs"  # the one ``include`` this server answers


class InputItem(BaseModel):
    """One item of ``input``: a message (``type`` "message", or left out), a call the model made, or its result."""

    model_config = P.STRICT

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[P.ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None

    _valid = field_validator("content", "arguments", "output")(P.valid_text)


class FunctionTool(BaseModel):
    model_config = P.STRICT

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolChoiceFunction(BaseModel):
    model_config = P.STRICT

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = P.STRICT

    format: TextFormat | None = None


class ResponsesRequest(P.Sampling):
    """OpenAI's fields, and the sampling extensions chat takes (``Sampling``: vLLM's and infer's)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    store: bool = True
    metadata: dict | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    priority: int = 0  # vLLM's, as on the chat route
    # what this server does not do: refused by name when asked for, never dropped in silence
    reasoning: dict | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None

    _valid = field_validator("input", "instructions")(P.valid_text)
    _no_reasoning = field_validator("reasoning")(P._unsupported("this model does not reason apart from its answer"))
    _no_conversation = field_validator("conversation")(P._unsupported(
        "no Conversations API: previous_response_id continues a stored response"))
    _no_prompt = field_validator("prompt")(P._unsupported("no stored prompt templates: give input and instructions"))
    _include = field_validator("include")(lambda v: v if not set(v or ()) - {LOGPROBS} else P._unsupported(
        f"only {LOGPROBS!r} can be included")(v))


def _messages(body: ResponsesRequest, history: list[P.ChatMessage]) -> list[P.ChatMessage]:
    """``input`` as chat messages after ``history`` (a previous response's conversation): a call joins the assistant
    message before it (or opens one), its output is a ``tool`` message."""
    out = list(history)
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise ApiError(400, f"{where}: a message needs a role", param="input")
            parts = item.content if isinstance(item.content, list) else None
            if parts is not None and (bad := next((p.type for p in parts if p.type not in (
                    "input_text", "output_text", "text")), None)):
                raise ApiError(400, f"{where}: content parts of type {bad!r} are not supported: this model reads "
                               "text only", param="input")
            content = item.content if parts is None else "".join(p.text or "" for p in parts)
            out.append(P.ChatMessage(role=item.role, content=content))
        elif item.type == "function_call":
            if item.name is None or item.arguments is None:
                raise ApiError(400, f"{where}: a function_call needs its name and arguments", param="input")
            call = P.ToolCall(id=item.call_id, function=P.FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant":  # a copy: the message may be a stored response's
                out[-1] = out[-1].model_copy(update={"tool_calls": (out[-1].tool_calls or []) + [call]})
            else:
                out.append(P.ChatMessage(role="assistant", tool_calls=[call]))
        else:
            if item.output is None:
                raise ApiError(400, f"{where}: a function_call_output needs its output", param="input")
            out.append(P.ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    if len(out) == len(history):
        raise ApiError(400, "input holds no message", param="input")
    return out


def _input_items(body: ResponsesRequest) -> list[dict]:
    """The request's ``input`` as OpenAI's stored items (each given an id), for ``GET .../input_items``."""
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out = []
    for item in items:
        if item.type == "message":
            text = item.content if not isinstance(item.content, list) else "".join(p.text or "" for p in item.content)
            part = ({"type": "output_text", "text": text or "", "annotations": []} if item.role == "assistant" else
                    {"type": "input_text", "text": text or ""})
            out.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": item.role, "content": [part],
                        "status": "completed"})
        elif item.type == "function_call":
            out.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments, "status": "completed"})
        else:
            out.append({"type": "function_call_output", "id": f"fco_{uuid.uuid4().hex}", "call_id": item.call_id,
                        "output": item.output, "status": "completed"})
    return out


def _structured(body: ResponsesRequest) -> StructuredOutput | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return StructuredOutput(json_object=True)
        if fmt.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return StructuredOutput(json_schema=fmt.schema_)
    except ValueError as e:
        raise ApiError(400, f"text.format: {e}", param="text") from None


async def _fitted(body: ResponsesRequest, state, messages: list[P.ChatMessage], chat_tools) -> list[int]:
    """The chat's prompt tokens; with ``truncation`` "auto", the oldest turns dropped (a turn: from a message to the
    next user message) until the prompt and ``max_output_tokens`` (or one token) fit the context. What cannot be cut
    (the instructions, leading system messages, the last turn) is left to the engine's length check."""
    def render(msgs):
        return render_chat(state, msgs, tools=P.tool_dicts(chat_tools), param="input")

    ids = await render(messages)
    if body.truncation != "auto":
        return ids
    room = state.max_seq_len - (body.max_output_tokens or 1)
    head = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    while len(ids) > room and (cut := next((j for j in range(head + 1, len(messages))
                                            if messages[j].role == "user"), None)) is not None:
        messages = messages[:head] + messages[cut:]
        ids = await render(messages)
    return ids


def _conversation(body: ResponsesRequest, state) -> tuple[list, list, list[P.Tool] | None]:
    """(the conversation: a stored response's history and this input; the chat messages: the instructions first;
    the tools as the chat's)."""
    history = []
    if body.previous_response_id is not None:
        if (prev := state.responses.get(body.previous_response_id)) is None:
            raise ApiError(404, f"no stored response {body.previous_response_id!r} (this server keeps the last "
                           f"{state.responses.capacity} responses asked with store, until it restarts)",
                           "not_found_error", "previous_response_id")
        if prev.running:
            raise ApiError(400, f"response {body.previous_response_id!r} is still running in the background: "
                           "continue it once it has ended", param="previous_response_id")
        history = prev.history
    conversation = _messages(body, history)  # (a content part the model cannot read is refused there)
    messages = ([P.ChatMessage(role="system", content=body.instructions)] if body.instructions is not None
                else []) + conversation  # instructions are this response's alone (OpenAI's rule)
    chat_tools = [P.Tool(type="function", function=P.FunctionDef(name=t.name, description=t.description,
                                                                   parameters=t.parameters, strict=t.strict))
                  for t in body.tools] if body.tools else None
    return conversation, messages, chat_tools


class InputTokensRequest(ResponsesRequest):
    model: str | None = None  # OpenAI's count takes none: the served model
    input: str | list[InputItem] = []


@router.post("/v1/responses/input_tokens")
async def input_tokens(body: InputTokensRequest, state: CurrentState):
    """OpenAI's count of a response's input tokens (``client.responses.input_tokens.count``): the prompt the same
    request would run, with ``truncation`` "auto"'s cut."""
    if body.model is not None:
        _check_model(state, body.model)
    if not state.tokenizer.has_chat_template:
        raise ApiError(400, "this model's tokenizer has no chat template; use /tokenize", param="input")
    _, messages, chat_tools = _conversation(body, state)
    return {"object": "response.input_tokens", "input_tokens": len(await _fitted(body, state, messages, chat_tools))}


@router.post("/v1/responses", responses=ANSWERS)
async def responses(body: ResponsesRequest, state: CurrentState, request: Request):
    lora = _check_model(state, body.model)
    tok = state.tokenizer
    if not tok.has_chat_template:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="input")
    if body.background and not body.store:
        raise ApiError(400, "background needs store: a background response is read back from the store",
                       param="background")
    conversation, messages, chat_tools = _conversation(body, state)
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        choice = P.NamedToolChoice(type="function", function=P.FunctionName(name=choice.name))
    mode, constraint = tools.plan(chat_tools, choice, body.parallel_tool_calls, state.tool_parser)
    structured, field = _structured(body), "text"
    if mode in ("named", "required"):
        if structured is not None:
            raise ApiError(400, f"tool_choice {mode!r} constrains the answer to a call already: give text.format or "
                           "tool_choice, not both", param="tool_choice")
        structured, field = constraint, "tools"
    ids = body.read_prompt(await _fitted(body, state, messages, chat_tools), state.max_seq_len)
    logprobs = (body.top_logprobs or 0) if LOGPROBS in (body.include or ()) else None

    def params() -> SamplingParams:
        return body.sampling_params(body.max_output_tokens or max(1, state.max_seq_len - len(ids)), logprobs,
                                    structured=structured)

    rid = f"resp_{uuid.uuid4().hex}"
    kw = ({} if body.speculation else {"speculate": False}) | ({"priority": body.priority} if body.priority else {}) \
        | ({"lora": lora} if lora is not None else {})
    stream = await add_stream(state, ids, params, rid, field, **kw)
    name = choice.function.name if mode == "named" else None
    c = _Choice(0, stream, ids, "", reader=None if mode is None else tools.ToolCallReader(mode, name,
                                                                                          state.tool_parser))

    job, inputs = None, _input_items(body)

    def keep(response: dict) -> None:
        if body.store:  # a background response was stored as it started: unless deleted meanwhile, it is replaced
            stored = Stored(response, conversation + answer_messages(response["output"]), job, inputs)
            (state.responses.update if job is not None else state.responses.put)(rid, stored)

    answer = Answer(state, body, rid, c, logprobs is not None, keep)
    if body.background:
        job = Job(answer)  # (its task starts once this handler awaits or returns: the response is stored first)
        state.responses.put(rid, Stored(job.snapshot(), [], job, inputs))
        if body.stream:
            return StreamingResponse(job.tail(), media_type="text/event-stream")
        return job.snapshot()
    if body.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream")
    if (gone := await consume_all(state, [c], request)) is not None:
        return gone
    answer.read(c.text, c.outputs, final=True)
    answer.finish()
    return answer.final()


@router.get("/v1/responses/{response_id}", responses=ANSWERS)
async def get_response(response_id: str, state: CurrentState, stream: bool = False,
                       starting_after: int | None = Query(None, ge=0)):
    """A stored response as it stands (as it was answered, or a background one as it runs); ``stream``: a
    background response's events, those after the one numbered ``starting_after`` (all by default), to its end."""
    stored = _stored(state, response_id)
    if not stream:
        return stored.current()
    if stored.job is None:
        raise ApiError(400, "only a background response can be streamed again: this one was answered in its "
                       "request", param="stream")
    return StreamingResponse(stored.job.tail(-1 if starting_after is None else starting_after),
                             media_type="text/event-stream")


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, state: CurrentState, after: str | None = None,
                      limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc"):
    """A stored response's own input items, a page of ``limit`` after the item ``after`` in ``order`` (OpenAI's
    cursor list: newest first by default)."""
    items = list(_stored(state, response_id).input)
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ApiError(400, f"no input item {after!r} in response {response_id!r}", param="after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: CurrentState):
    """Stop a background response (its output so far kept, status "cancelled"); one that has ended is returned as
    it ended."""
    stored = _stored(state, response_id)
    if stored.job is None:
        raise ApiError(400, "only a background response can be cancelled: this one was answered in its request",
                       param="response_id")
    await stored.job.stop()
    return (state.responses.get(response_id) or stored).current()


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: CurrentState):
    _stored(state, response_id)
    state.responses.delete(response_id)  # (a background response still running is cancelled)
    return {"id": response_id, "object": "response", "deleted": True}


def _stored(state, response_id: str):
    if (stored := state.responses.get(response_id)) is None:
        raise ApiError(404, f"no stored response {response_id!r}", "not_found_error", "response_id")
    return stored
