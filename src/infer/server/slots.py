"""llama-server's ``GET /slots``: what each of the engine's KV slots holds now (``max_batch_size`` of them: /props'
``total_slots``): whether a request decodes there, its sampling parameters under llama.cpp's names, the tokens it has
decoded and has left. Dashboards and llama.cpp's tools read it; ``?fail_on_no_slot=1`` answers 503 while every slot
is taken (a load balancer's probe), as llama-server does. On by default (llama-server's ``--no-slots`` turns it off:
501 then). No prompt or output text is shown: a reader sees what runs, not what anyone wrote."""

from __future__ import annotations

from fastapi import APIRouter

from ..request import Request
from .errors import error_response
from .llamacpp import DEFAULTS
from .state import CurrentState

router = APIRouter()

UNSET_SEED = 4294967295  # llama.cpp's LLAMA_DEFAULT_SEED: the request gave none


def _params(r: Request, lora_scale: float) -> dict:
    """A running request's sampling parameters as llama-server names them (its slot's ``params``)."""
    p = r.params
    return {"n_predict": p.max_tokens, "seed": UNSET_SEED if p.seed is None else p.seed,
            "temperature": p.temperature, "top_k": max(p.top_k, 0), "top_p": p.top_p, "min_p": p.min_p,
            "typical_p": 1.0, "repeat_last_n": -1,  # infer's repetition penalty counts the whole context
            "repeat_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "max_tokens": p.max_tokens, "ignore_eos": p.ignore_eos,
            "n_probs": p.logprobs or 0, "stop": [p.stop] if isinstance(p.stop, str) else list(p.stop or []),
            "lora": [] if r.lora_name is None else [{"id": r.lora_salt, "name": r.lora_name, "scale": lora_scale}]}


def _next_token(r: Request | None) -> dict:
    if r is None:
        return {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    n = len(r.output_ids)
    return {"has_next_token": not r.finished, "has_new_line": "\n" in r.text,
            "n_remain": max(r.params.max_tokens - n, 0), "n_decoded": n}


def slots_report(state) -> list[dict]:
    """One entry per KV slot, in slot order: the request in it (admitted, not yet finished and freed) or none."""
    eng = state.engine.engine
    cfg = eng.config
    by_slot = {r.slot: r for r in list(eng.scheduler.running) if r.slot is not None}  # the model thread's list, copied
    # K's range: a pinned K; "egag"'s [spec_length_min, spec_length_max]; "auto"'s 0 .. spec_length_max
    fixed = isinstance(cfg.spec_length, int)
    k_max, k_min = (cfg.spec_length, cfg.spec_length) if fixed else \
        (cfg.spec_length_max, cfg.spec_length_min if cfg.spec_length == "egag" else 0)
    spec = {"speculative.n_max": k_max if state.speculative else 0,
            "speculative.n_min": k_min if state.speculative else 0}
    out = []
    for slot in range(cfg.max_batch_size):
        r = by_slot.get(slot)
        params = dict(DEFAULTS, seed=UNSET_SEED, lora=[]) if r is None else _params(r, eng.loras.scale)
        out.append({"id": slot, "id_task": -1 if r is None else r.seq, "n_ctx": state.max_seq_len,
                    "speculative": state.speculative and (r is None or r.speculate), "is_processing": r is not None,
                    "params": {**params, **spec}, "next_token": _next_token(r),
                    # infer's own: the request's id (its response's) and prompt length
                    "request_id": None if r is None else r.request_id,
                    "n_prompt_tokens": 0 if r is None else len(r.prompt_ids)})
    return out


@router.get("/slots")
async def slots(state: CurrentState, fail_on_no_slot: str | None = None):
    """llama-server's per-slot state; 503 with ``fail_on_no_slot`` (any value but 0/false) while no slot is free."""
    if not state.slots:
        return error_response(501, "this server does not serve /slots: it was started with --no-slots",
                              "not_supported_error")
    report = slots_report(state)
    if fail_on_no_slot not in (None, "", "0", "false") and all(s["is_processing"] for s in report):
        return error_response(503, "no slot available", "unavailable_error")
    return report
