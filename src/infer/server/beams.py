"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions: ``n`` beams of each prompt, best first, as
``LLM.beam_search`` finds them (Hugging Face's semantics; ``AsyncEngine.beam_search`` steps the search through engine
requests), answered whole. The fields a beam search cannot honour are refused by name, never dropped."""

from __future__ import annotations

import asyncio

from fastapi import Request

from ..beam import BeamHypothesis, BeamSearchParams, engine_search
from ..engine import QueueFullError
from . import protocol as P
from .errors import ApiError
from .state import ServerState

# fields that would change a beam search's output and that it does not apply: a 400 naming them unless at their
# defaults. The search reads the target's own law (temperature 1 or 0: the same beams) and ends at EOS or max_tokens.
NOT_WITH_BEAMS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                  "logit_bias", "stop_token_ids", "min_tokens", "bad_words", "allowed_token_ids", "logprobs",
                  "top_logprobs", "prompt_logprobs", "response_format", "structured_outputs", "guided_json",
                  "guided_regex", "guided_choice", "guided_grammar", "stream", "priority")
BEAM_ONLY = ("length_penalty", "early_stopping")  # a beam search's own: refused without use_beam_search


def check(body) -> None:
    """A 400 naming the first field that does not go with the request's use_beam_search (or lack of it)."""
    fields = type(body).model_fields
    if not body.use_beam_search:
        for name in BEAM_ONLY:
            if getattr(body, name) != fields[name].default:
                raise ApiError(400, f"{name} scores beams: give use_beam_search true", param=name)
        return
    if body.temperature not in (0.0, 1.0):
        raise ApiError(400, "a beam search reads the model's own law: temperature must be 1 (or 0), got "
                       f"{body.temperature}", param="temperature")
    for name in NOT_WITH_BEAMS:
        if name in fields and getattr(body, name) != fields[name].default:
            raise ApiError(400, f"{name} does not apply to a beam search (use_beam_search); ask without it",
                           param=name)


async def serve(state: ServerState, body, prompts: list[list[int]], max_tokens: int, chat: bool, echo: list[str],
                request: Request, lora: str | None = None):
    """The beams of every prompt as one JSON body: ``n`` choices a prompt (prompt i's j-th beam at index i * n + j),
    or a 499 if the client left first (the search's requests are aborted)."""
    try:
        params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                  length_penalty=body.length_penalty, early_stopping=body.early_stopping)
        for ids in prompts:  # every prompt checked before any search starts
            engine_search(state.engine.engine, ids, params)
    except ValueError as e:
        raise ApiError(400, str(e), param="prompt" if "prompt" in str(e) else "n")
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    searches = [asyncio.ensure_future(state.engine.beam_search(ids, params, f"{rid}-{i}", lora))
                for i, ids in enumerate(prompts)]
    work = asyncio.gather(*searches)
    from .completions import watched  # the client watch of every route (imported here: completions imports us)

    try:
        if (gone := await watched(work, request)) is not None:
            return gone
    except QueueFullError as e:  # a step's requests found the queue full (--max-waiting-requests)
        raise ApiError(503, f"server busy: {e}", "server_error", headers={"Retry-After": "1"}) from e
    finally:  # the client gone, or one search failed: the others' requests are aborted too
        for t in searches:
            t.cancel()
    results: list[list[BeamHypothesis]] = work.result()
    eos = set(state.engine.engine.eos_token_ids)
    skip = body.skip_special_tokens is not False
    choices, completion = [], 0
    for i, hyps in enumerate(results):
        for j, h in enumerate(hyps):
            text = echo[i] + state.tokenizer.decode(h.token_ids, skip_special_tokens=skip)
            finish = "stop" if not body.ignore_eos and h.token_ids[-1:] and h.token_ids[-1] in eos else "length"
            state.metrics.requests.labels(finish).inc()
            completion += len(h.token_ids)
            choice = {"index": i * body.n + j, "logprobs": None, "finish_reason": finish}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": P.now(),
            "model": body.model, "choices": choices,
            "usage": P.usage(sum(len(p) for p in prompts), completion, 0, 0, state.speculative)}
