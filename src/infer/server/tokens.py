"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's token ids for a text or a chat (as the chat route
would feed them), and the text of ids, so a client can count and budget tokens without a tokenizer of its own.
llama-server's fields too: a text as ``content`` (``add_special``, false by default, ``parse_special``, ``with_pieces``:
each id with its text, a partial character shown as U+FFFD), answered ``{"tokens"}`` as llama.cpp answers; the text of
ids as ``content`` beside vLLM's ``prompt``; ``model`` optional (the served model). Tokenisation runs in a worker
thread, as the generation routes' does."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, field_validator
from starlette.concurrency import run_in_threadpool

from . import protocol as P
from .chat_render import render_request_chat
from .completions import _check_ids, _check_model
from .errors import ApiError
from .state import CurrentState

router = APIRouter()


class TokenizeRequest(BaseModel):
    """A text (``prompt``) or a chat (``messages``, rendered by the chat template with the assistant's turn opened)."""

    model_config = P.STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = Field(None, min_length=1)
    content: str | None = None  # llama.cpp's text, with its three options
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    tools: list[P.Tool] | None = None  # given to the chat template with messages, as the chat route gives them
    # as the chat route renders messages (vLLM's tokenize takes the same)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    _valid_prompt = field_validator("prompt", "content")(P.valid_text)


class DetokenizeRequest(BaseModel):
    model_config = P.STRICT

    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: CurrentState):
    if body.model is not None:
        _check_model(state, body.model)
    if sum(x is not None for x in (body.prompt, body.messages, body.content)) != 1:
        raise ApiError(400, "give prompt (a text) or messages (a chat), one of them (llama.cpp's content: a text)",
                       param="prompt")
    if body.content is not None:  # llama.cpp's answer
        ids = await run_in_threadpool(state.tokenizer.encode, body.content, add_special_tokens=body.add_special,
                                      split_special_tokens=not body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        pieces = await run_in_threadpool(lambda: [state.tokenizer.decode([i], skip_special_tokens=False)
                                                  for i in ids])
        return {"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces)]}
    if body.messages is not None:
        ids = await render_request_chat(state, body, "tokenize a prompt", P.tool_dicts(body.tools))
    else:
        ids = await run_in_threadpool(state.tokenizer.encode, body.prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_seq_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: CurrentState):
    if body.model is not None:
        _check_model(state, body.model)
    _check_ids([body.tokens], state.vocab_size, param="tokens")
    text = await run_in_threadpool(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text, "content": text}  # vLLM's name, llama.cpp's
