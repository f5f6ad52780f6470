"""OpenAI's ``/v1/embeddings`` (vLLM's, llama.cpp's ``--embeddings``): each input's final states pooled into one
vector by the served model itself (infer.pooling: the server's ``--pooling``, the last token's by default), as
floats or as OpenAI's base64 of little-endian float32 (the ``openai`` client asks for that by default); or vLLM's
chat form, one conversation's ``messages`` rendered as the chat route renders them. Every input is tokenised and
checked before any is embedded; each runs on the engine's thread between two steps, taking no KV block from the
requests generating beside it."""

from __future__ import annotations

import base64
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field, field_validator
from starlette.concurrency import run_in_threadpool

from ..engine.async_engine import EngineStoppedError
from ..pooling import PoolingParams
from . import protocol as P
from .chat_render import render_request_chat
from .completions import _check_model, _prompt_ids
from .errors import ApiError
from .state import CurrentState

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = P.STRICT

    model: str
    input: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's chat form: one conversation, rendered as the chat route renders it (no assistant turn opened unless
    # asked), embedded as one input
    messages: list[P.ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models' shortened vectors: this model has one length (refused else)
    # vLLM's
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None  # None: L2-normalized, as vLLM's default

    _valid_input = field_validator("input")(P.valid_text)
    _truncate = field_validator("truncate_prompt_tokens")(P.valid_truncation)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, state: CurrentState):
    _check_model(state, body.model, "embedding")
    width = state.engine.engine.model.config.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise ApiError(400, f"this model's embeddings have {width} values; dimensions shortens only a "
                       "Matryoshka-trained model's, which this is not", param="dimensions")
    params = PoolingParams(state.pooling, body.normalize is not False, body.truncate_prompt_tokens)
    if (body.input is None) == (body.messages is None):
        raise ApiError(400, "give input (texts or token ids) or messages (a chat), one of them", param="input")
    if body.messages is not None:
        prompts = [await render_request_chat(state, body, "give input")]
    else:
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or "" in texts:  # as OpenAI's: an empty text has nothing to embed (but its tokenizer's BOS)
            raise ApiError(400, "input is empty: give a text, a list of texts or token ids, none of them empty",
                           param="input")
        prompts = await run_in_threadpool(_prompt_ids, state.tokenizer, body.input, state.vocab_size, "input")
    try:  # every input checked before any runs
        prompts = [state.engine.engine.check_embedding(p, params) for p in prompts]
    except ValueError as e:
        where = "input" if body.messages is None else "messages"
        raise ApiError(400, f"{where}: {e}", param=where) from None
    data, tokens = [], 0
    for i, ids in enumerate(prompts):
        try:
            vector = await state.engine.embed(ids, params)  # [hidden_size] float32
        except EngineStoppedError as e:  # e.g. the model thread died: nothing can run now
            raise ApiError(503, str(e), "server_error") from e
        tokens += len(ids)
        data.append({"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)})
    state.metrics.embedded(len(prompts), tokens)
    return {"object": "list", "data": data, "model": state.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector, fmt: str):
    if fmt == "float":
        return vector.tolist()
    return base64.b64encode(vector.contiguous().numpy().astype("<f4").tobytes()).decode()
