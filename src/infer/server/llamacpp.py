"""llama.cpp's own server routes (llama-server's, beside the OpenAI ones), so that a client written against them talks
to infer unchanged: ``POST /completion`` (also ``/completions``: a ``prompt`` as text, token ids or both mixed,
``n_predict``, llama.cpp's sampling fields and defaults, ``stop``, ``grammar`` (GBNF) and ``json_schema``, ``n_probs``;
the answer's ``content``, ``stop_type`` / ``stopping_word``, ``tokens_cached``, and ``timings`` with the drafts a
speculating engine made and had accepted, as llama-server reports its own speculation), streamed as llama.cpp streams
it (a ``data:`` line a piece, the last one ``"stop": true`` with the whole account), ``GET /props`` (the defaults,
the context, the chat template), ``POST /apply-template`` (a chat as its prompt text). ``/tokenize`` and
``/detokenize`` (tokens.py) take llama.cpp's fields too.

Where llama.cpp's meaning and infer's differ, the request is refused by name, never answered another way: its
penalties count the last ``repeat_last_n`` tokens (infer's repetition penalty counts the whole context: given with
``repeat_last_n`` -1; its presence and frequency penalties, OpenAI's, the output: /v1/completions), and the samplers
infer does not have (DRY, XTC, Mirostat, typical, dynamic temperature, a ``samplers`` order). One difference is
stated, not refused: infer applies temperature before top-k / top-p / min-p (as Hugging Face and vLLM do), where
llama.cpp's default chain applies it last."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, field_validator
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..sampling import MAX_LOGPROBS, SamplingParams
from ..structured import StructuredOutput
from . import protocol as P
from .chat_render import check_readable, check_template, render_chat
from .completions import ANSWERS, _check_ids, _Choice, add_stream, consume_all
from .errors import ApiError
from .state import CurrentState

router = APIRouter()

# llama-server's defaults (common/common.h), which a request's absent fields take
DEFAULTS = {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0,
            "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop": [], "seed": -1, "ignore_eos": False, "n_probs": 0, "grammar": ""}


def _off(why: str, off=(None, 0, 0.0, 1, 1.0, False, "", [])):
    return P._unsupported(why, off)


class CompletionBody(BaseModel):
    model_config = P.STRICT

    model: str | None = None  # as llama-server, not checked: a LoRA adapter's id picks it, any other the base model
    prompt: str | list[int | str] | list[str | list[int | str]]
    n_predict: int = Field(-1, ge=-1)  # -1: to the context's end
    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = Field(0.95, gt=0)  # >= 1: off
    min_p: float = Field(0.05, ge=0, le=1)
    repeat_penalty: float = Field(1.0, gt=0)
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = []
    stream: bool = False
    seed: int = Field(-1, ge=-1, le=2**63 - 1)  # -1 (or llama.cpp's 0xFFFFFFFF): random
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    grammar: str = ""
    json_schema: dict | None = None
    logit_bias: list[list] | dict[str, float | bool] | None = None
    return_tokens: bool = False
    cache_prompt: bool = True  # the prefix cache is always on, and exact: nothing to turn off
    id_slot: int = -1  # slots are the scheduler's: a hint with no effect on the answer
    timings_per_token: bool = False
    # llama.cpp's samplers and settings infer does not have: refused off their defaults, never dropped in silence
    typical_p: float = 1.0
    dynatemp_range: float = 0.0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    mirostat: int = 0
    samplers: list[str] | str | None = None
    n_keep: int = 0
    n_indent: int = 0
    t_max_predict_ms: int = 0
    n_cmpl: int = 1
    lora: list | None = None
    post_sampling_probs: bool = False
    response_fields: list[str] | None = None

    _valid = field_validator("prompt", "stop", "grammar")(P.valid_text)
    _no_typical = field_validator("typical_p")(_off("no locally typical sampling"))
    _no_dynatemp = field_validator("dynatemp_range")(_off("no dynamic temperature"))
    _no_dry = field_validator("dry_multiplier")(_off("no DRY repetition penalty"))
    _no_xtc = field_validator("xtc_probability")(_off("no XTC sampler"))
    _no_mirostat = field_validator("mirostat")(_off("no Mirostat sampling"))
    _no_samplers = field_validator("samplers")(_off("the sampler order is infer's: temperature, top-k, top-p, min-p"))
    _no_keep = field_validator("n_keep", "n_indent", "t_max_predict_ms")(_off("no context shift, indent or time "
                                                                                "limit"))
    _no_cmpl = field_validator("n_cmpl")(_off("one completion a prompt: /v1/completions' n gives several"))
    _no_lora = field_validator("lora")(_off("LoRA adapters are picked by model id (/v1/load_lora_adapter)"))
    _no_post = field_validator("post_sampling_probs", "response_fields")(_off("probabilities are the target's "
                                                                              "log-probabilities, fields all given"))

    def structured(self) -> StructuredOutput | None:
        if self.json_schema is not None and self.grammar:
            raise ApiError(400, "give grammar or json_schema, not both", param="grammar")
        try:
            if self.grammar:
                return StructuredOutput(grammar=self.grammar)
            return None if self.json_schema is None else StructuredOutput(json_schema=self.json_schema)
        except ValueError as e:
            raise ApiError(400, str(e), param="grammar" if self.grammar else "json_schema") from None

    def sampling(self, max_tokens: int, vocab: int) -> SamplingParams:
        if self.repeat_penalty != 1.0 and self.repeat_last_n != -1:
            raise ApiError(400, "repeat_penalty here counts the whole context (prompt and output), not the last "
                           "repeat_last_n tokens: give repeat_last_n -1, or repeat_penalty 1", param="repeat_penalty")
        if self.presence_penalty or self.frequency_penalty:
            raise ApiError(400, "llama.cpp's presence and frequency penalties count the last repeat_last_n tokens, "
                           "this server's (OpenAI's) the output's: ask /v1/completions for them",
                           param="presence_penalty" if self.presence_penalty else "frequency_penalty")
        bias, banned = _bias(self.logit_bias, vocab)
        return SamplingParams(temperature=max(self.temperature, 0.0), top_k=max(self.top_k, 0),
                              top_p=min(self.top_p, 1.0), min_p=self.min_p, repetition_penalty=self.repeat_penalty,
                              logit_bias=bias, bad_words=banned, max_tokens=max_tokens, stop=self.stop or None,
                              seed=None if self.seed in (-1, 0xFFFFFFFF) else self.seed, ignore_eos=self.ignore_eos,
                              logprobs=self.n_probs or None, structured=self.structured())


def _bias(bias, vocab: int) -> tuple[dict[int, float] | None, list[list[int]] | None]:
    """llama.cpp's logit_bias ([[id, bias], ...] or {"id": bias}) as (token id -> bias, the ids it bans: bias
    false, a ban as bad_words bans a one-token sequence, not a large negative bias)."""
    if not bias:
        return None, None
    pairs = bias.items() if isinstance(bias, dict) else bias
    out, banned = {}, []
    for pair in pairs:
        key, value = pair if len(pair) == 2 else (None, None)
        tid = key if type(key) is int else int(key) if isinstance(key, str) and key.isdigit() else None
        if tid is None or not 0 <= tid < vocab or not isinstance(value, (int, float)):
            raise ApiError(400, f"logit_bias: {list(pair)!r} is no (token id, bias or false) pair of this "
                           f"vocabulary ({vocab} tokens); text keys are not read", param="logit_bias")
        if value is False:
            banned.append([tid])
        else:
            out[tid] = float(value)
    return out or None, banned or None


async def _prompts(state, prompt) -> list[list[int]]:
    """Token ids of each prompt: a text (encoded as /v1/completions encodes it), ids, or both mixed (texts after the
    first piece without special tokens); a list of texts or of such lists is several prompts."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        prompt = [prompt]
    elif prompt and all(isinstance(p, int) or isinstance(p, str) for p in prompt) and any(
            isinstance(p, int) for p in prompt):
        prompt = [prompt]  # one mixed prompt
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    out = []
    for p in prompt:
        pieces = [p] if isinstance(p, (str, int)) else p
        ids = []
        for i, piece in enumerate(pieces):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += await run_in_threadpool(state.tokenizer.encode, piece, add_special_tokens=i == 0)
        if not ids:
            raise ApiError(400, "prompt is empty", param="prompt")
        out.append(ids)
    _check_ids(out, state.vocab_size)
    return out


def _stop_type(c: _Choice, last) -> tuple[str, str]:
    if c.finish_reason == "length":
        return "limit", ""
    if isinstance(last.stop_reason, str):
        return "word", last.stop_reason
    return "eos", ""


def _timings(c: _Choice) -> dict:
    """llama-server's timings, measured here: the prompt's time to the first token (queueing included), the rest's
    after it; draft_n / draft_n_accepted: the request's drafts and the accepted among them."""
    first = c.t_first if c.t_first is not None else time.monotonic()
    end = c.t_last if c.t_last is not None else first
    n_prompt, n_out = len(c.prompt_ids) - c.cached, len(c.outputs)
    p_ms, t_ms = (first - c.t0) * 1e3, (end - first) * 1e3
    out = {"cache_n": c.cached, "prompt_n": n_prompt, "prompt_ms": p_ms,
           "prompt_per_token_ms": p_ms / max(n_prompt, 1), "prompt_per_second": 1e3 * n_prompt / p_ms if p_ms else 0.0,
           "predicted_n": n_out, "predicted_ms": t_ms, "predicted_per_token_ms": t_ms / max(n_out - 1, 1),
           "predicted_per_second": 1e3 * (n_out - 1) / t_ms if t_ms else 0.0}
    if c.draft:
        out |= {"draft_n": c.draft, "draft_n_accepted": c.accepted}
    return out


def _probs(tok, outs) -> list[dict]:
    def entry(tid: int, lp: float) -> dict:
        piece = tok.decode([tid], skip_special_tokens=False)
        return {"id": tid, "token": piece, "bytes": list(piece.encode("utf-8")), "logprob": lp}
    return [{**entry(o.token_id, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top_logprobs or ()]}
            for o in outs if o.token_id is not None and o.logprob is not None]


def _settings(state, body: CompletionBody, n_predict: int) -> dict:
    fields = {k: getattr(body, k) for k in DEFAULTS}
    return {**fields, "n_predict": n_predict, "n_ctx": state.max_seq_len, "model": state.served_model_name,
            "speculative": state.speculative, "stream": body.stream, "cache_prompt": True}


def _final(state, body, c: _Choice, last, n_predict: int, truncated: bool) -> dict:
    kind, word = _stop_type(c, last)
    out = {"index": c.index, "content": c.text, "tokens": [o.token_id for o in c.outputs] if body.return_tokens else [],
           "id_slot": 0, "stop": True, "model": state.served_model_name, "tokens_predicted": len(c.outputs),
           "tokens_evaluated": len(c.prompt_ids), "generation_settings": _settings(state, body, n_predict),
           "prompt": state.tokenizer.decode(c.prompt_ids, skip_special_tokens=False),
           "has_new_line": "\n" in c.text, "truncated": truncated, "stop_type": kind, "stopping_word": word,
           "tokens_cached": c.cached, "timings": _timings(c)}
    if body.n_probs:
        out["completion_probabilities"] = _probs(state.tokenizer, c.outputs)
    return out


@router.post("/completion", responses=ANSWERS)
@router.post("/completions", responses=ANSWERS)
async def completion(body: CompletionBody, request: Request, state: CurrentState):
    lora = body.model if body.model in state.lora_modules else None
    prompts = await _prompts(state, body.prompt)
    if body.stream and len(prompts) > 1:
        raise ApiError(400, "several prompts are answered whole, not streamed: ask with stream false", param="stream")
    budgets = []
    for ids in prompts:
        room = state.max_seq_len - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) fills the context ({state.max_seq_len} tokens)",
                           param="prompt")
        # n_predict 0 evaluates the prompt alone (into the prefix cache, where it is on): one token is made, not given
        budgets.append(room if body.n_predict == -1 else min(max(body.n_predict, 1), room))
    kw = {"lora": lora} if lora else {}
    choices = []
    try:
        for i, (ids, budget) in enumerate(zip(prompts, budgets)):
            stream = await add_stream(state, ids, lambda b=budget: body.sampling(b, state.vocab_size),
                                      f"{P.new_id('cmpl')}-{i}", "json_schema" if body.json_schema else "grammar",
                                      **kw)
            choices.append(_Choice(i, stream, ids, ""))
    except BaseException:
        for c in choices:
            c.stream.close()
        raise
    if body.stream:
        return StreamingResponse(_events(state, body, choices[0]), media_type="text/event-stream")
    if (gone := await consume_all(state, choices, request)) is not None:
        return gone
    answers = [_answer(state, body, c) for c in choices]
    return answers[0] if len(answers) == 1 else answers


def _answer(state, body, c: _Choice) -> dict:
    if body.n_predict == 0:  # the warm-up's token is not an answer
        c.outputs, c.text, c.finish_reason = [], "", "length"
    # truncated: the answer ran into the context's end (llama.cpp's flag), not into n_predict
    full = c.finish_reason == "length" and body.n_predict == -1 and len(c.prompt_ids) + len(c.outputs) >= \
        state.max_seq_len
    return _final(state, body, c, c.last, body.n_predict, full)


async def _events(state, body, c: _Choice):
    held = []  # outputs whose text is held back (a stop string's start, part of a character): sent with it
    try:
        async for out in c.stream:
            c.observe(out, state.metrics)
            if body.n_predict == 0:
                continue
            if out.token_id is not None:
                held.append(out)
            if not out.text:
                continue
            piece = {"index": 0, "content": out.text, "tokens": [o.token_id for o in held], "stop": False,
                     "id_slot": 0, "tokens_predicted": len(c.outputs), "tokens_evaluated": len(c.prompt_ids)}
            if body.n_probs:
                piece["completion_probabilities"] = _probs(state.tokenizer, held)
            held = []
            if body.timings_per_token:
                piece["timings"] = _timings(c)
            yield f"data: {json.dumps(piece)}\n\n"
    except Exception as e:  # noqa: BLE001 - the stream has begun: llama-server's error line
        yield f"data: {json.dumps({'error': {'code': 500, 'message': str(e), 'type': 'server_error'}})}\n\n"
        return
    finally:
        c.stream.close()
    yield f"data: {json.dumps({**_answer(state, body, c), 'content': '', 'tokens': []})}\n\n"


@router.get("/props")
async def props(state: CurrentState):
    """llama-server's global properties: /completion's defaults, the context, the slots, the chat template."""
    cfg = getattr(state.engine, "engine", None)
    cfg = getattr(cfg, "config", None)
    tok = state.tokenizer
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": state.max_seq_len,
                                            "speculative": state.speculative, "is_processing": False,
                                            "params": dict(DEFAULTS)},
            "total_slots": getattr(cfg, "max_batch_size", 1), "model_path": str(getattr(cfg, "model", "")),
            "model_alias": state.served_model_name,
            "chat_template": getattr(getattr(tok, "hf", None), "chat_template", None) or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"infer {__version__}",
            "is_sleeping": False}


class ApplyTemplateBody(BaseModel):
    model_config = P.STRICT

    messages: list[P.ChatMessage] = Field(min_length=1)
    tools: list[P.Tool] | None = None


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateBody, state: CurrentState):
    """A chat as the prompt text the chat route would feed the model (the assistant's turn opened)."""
    check_template(state, None, "send /completion a prompt of your own")
    check_readable(body.messages)
    ids = await render_chat(state, body.messages, tools=P.tool_dicts(body.tools))
    return {"prompt": state.tokenizer.decode(ids, skip_special_tokens=False)}
