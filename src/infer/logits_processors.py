"""Logits processors (vLLM's ``SamplingParams.logits_processors``, Hugging Face's ``logits_processor``): a request's
own functions that reshape the target's logits for its next token, given the tokens before it.

A processor is ``fn(output_ids, logits) -> logits`` or ``fn(prompt_ids, output_ids, logits) -> logits`` (vLLM's two
forms): ``logits`` is one position's float tensor [V], returned reshaped (a new tensor, or the same one changed in
place). The request's processors run first, in order, before every other rule (min_tokens, bad words, a grammar,
penalties, temperature, top-k/p): the law the request samples is the processed target's, and the logprobs it reports
are that law's.

Exactness under speculation: a verify calls them at each position it judges, with the output plus the drafts before
that position (a tree node: the drafts on its path), so each position's law is the one plain decoding would sample
after those tokens. The drafters do not see them: a draft a processor rules out has p = 0 there and is rejected, and
the residual puts its mass back. Hence a processor must be a function of its arguments: it is also called for
positions whose tokens the round then rejects, so state kept across calls would count tokens never output.
"""

from __future__ import annotations

import inspect

import torch


def _positional(fn) -> int | None:
    """How many positional arguments ``fn`` takes (2 or 3 for a processor), or None where Python cannot tell (a
    builtin): such a function is called with two."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def check_processors(fns) -> list | None:
    """``SamplingParams.logits_processors`` as kept (a list, None if empty); ValueError naming the first entry that is
    not a function of (output_ids, logits) or (prompt_ids, output_ids, logits)."""
    if fns is None:
        return None
    if not isinstance(fns, (list, tuple)):
        raise ValueError(f"SamplingParams.logits_processors must be a list of functions, got {type(fns).__name__}")
    for i, fn in enumerate(fns):
        if not callable(fn) or _positional(fn) not in (None, 2, 3):
            raise ValueError(f"SamplingParams.logits_processors[{i}] must be a function of (output_ids, logits) or "
                             f"(prompt_ids, output_ids, logits), got {fn!r}")
    return list(fns) or None


def bind_processors(fns: list | None) -> list[tuple] | None:
    """A request's checked processors as (function, whether it takes the prompt) pairs: each signature read once."""
    return None if not fns else [(fn, _positional(fn) == 3) for fn in fns]


def _run(bound: list[tuple], prompt_ids: list[int], output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    for fn, takes_prompt in bound:
        out = fn(prompt_ids, output_ids, row) if takes_prompt else fn(output_ids, row)
        if not isinstance(out, torch.Tensor) or out.shape != row.shape:
            raise TypeError(f"the logits processor {fn!r} returned {type(out).__name__}"
                            f"{'' if not isinstance(out, torch.Tensor) else ' of shape ' + str(tuple(out.shape))}: "
                            f"it must return the position's logits, a tensor of shape {tuple(row.shape)}")
        row = out
    return row


def apply_logits_processors_(logits: torch.Tensor, reqs, drafted: list[list[list[int]]] | None = None) -> None:
    """Each request's processors over its logits, in place: logits [B, V] (each request's next token) or [B, T, V] (a
    verify or a tree: position t of row b follows the output plus ``drafted[b][t]``, the drafts before it; a row's
    positions past ``len(drafted[b])`` are padding and left alone). A processor sees copies of the token lists.
    ValueError where they leave a position no token with a finite logit (a law of nothing); what a processor raises
    is raised here (``LLM.generate`` then aborts its requests: the engine is left clean)."""
    for b, r in enumerate(reqs):
        if not r.logits_processors:
            continue
        prompt = list(r.prompt_ids)
        for t, before in enumerate(drafted[b] if drafted is not None and logits.dim() == 3 else [[]]):
            row = logits[b] if logits.dim() == 2 else logits[b, t]
            output = r.output_ids + list(before)
            new = _run(r.logits_processors, prompt, output, row)
            if not bool(torch.isfinite(new).any()):
                raise ValueError(f"request {r.request_id}: its logits processors left no token with a finite logit "
                                 f"after {len(output)} output tokens: there is nothing to sample")
            if new is not row:
                row.copy_(new)
