"""speculative_generate: the library-level call for one sequence, on loaded models.

It runs the engine's own round (spec_decode.round) for a batch of one: an Engine over the given models with one
contiguous KV slot sized for this request, one request, stepped to the end. There is no second decoding loop to
drift from the engine's: whatever ``LLM`` and the server do to a sequence, this does.

    req, stats = speculative_generate(target, drafter, prompt_ids, SamplingParams(temperature=0, max_tokens=64))
    req.output_ids, req.acceptance_rate, stats.realized_acceptance, [r.k for r in stats.rounds]

The first token comes from the target's prefill, as in the engine; every later round drafts K (``spec_length``:
an integer, "auto" or "egag") and verifies them in one target forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model.llama import LlamaForCausalLM
from .proposers.draft_vocab import DraftVocab
from .request import Request
from .sampling import SamplingParams
from .spec_decode.round import RoundRecord
from .tokenizer import Tokenizer


@dataclass
class SpecStats:
    rounds: list[RoundRecord] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: rounds whose draft k was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [k]: rounds that drafted position k

    def record(self, r: RoundRecord) -> None:
        self.rounds.append(r)
        while len(self.drafted_per_position) < r.k:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(r.k):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < r.num_accepted

    @property
    def expected_acceptance(self) -> float | None:
        """Theory's per-position acceptance: mean of sum_x min(p, q) over the positions actually judged.

        A judged draft is accepted with probability exactly sum_x min(p(x), q(x)) for its context, so this and
        ``realized_acceptance`` agree up to sampling noise; a persistent gap signals a broken verifier.
        """
        vals = [v for r in self.rounds for v in r.expected_accept[: r.tested]]
        return sum(vals) / len(vals) if vals else None

    @property
    def realized_acceptance(self) -> float | None:
        """Accepted drafts / judged drafts (drafts after a rejection are never judged)."""
        judged = sum(r.tested for r in self.rounds)
        return sum(r.num_accepted for r in self.rounds) / judged if judged else None


@torch.inference_mode()
def speculative_generate(
    target: LlamaForCausalLM,
    drafter: LlamaForCausalLM | None,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    spec_length: int | str = "auto",
    eos_token_ids: list[int] | None = None,
    tokenizer: Tokenizer | None = None,
    generator: torch.Generator | None = None,
    max_new_tokens: int | None = None,
    debug: bool | callable = False,
    draft_vocab: DraftVocab | None = None,
    proposer: str | None = None,
    kv_cache_backend: str = "contiguous",
    draft_tokenizer: Tokenizer | None = None,
    **spec_options,
) -> tuple[Request, SpecStats]:
    """Decode one sequence speculatively; returns the finished Request (tokens, text, counters) and SpecStats.

    ``drafter`` None drafts by prompt lookup (``proposer="ngram"``); with a drafter, ``proposer`` may be "draft"
    (default), "hybrid" or "suffix-hybrid". ``draft_vocab``: the drafter scores only those tokens plus the prompt's (lossless).
    ``draft_tokenizer``: the drafter's tokenizer where it is not the target's (``tokenizer`` needed too): drafts
    cross between the vocabularies (proposers.cross_tokenizer; ``cross_tokenizer="string"`` or "intersection").
    ``debug``: True prints each round (colours on a TTY); a callable receives (RoundRecord, Request).
    ``spec_options``: any speculative field of EngineConfig (spec_tree, spec_length_min / _max, egag_ema_beta,
    prompt_lookup_min / _max, acceptance, lenience, typical_epsilon, typical_delta).
    """
    from .engine import Engine, EngineConfig

    params = params or SamplingParams()
    if max_new_tokens is not None:
        params = SamplingParams(**{**params.__dict__, "max_tokens": max_new_tokens})
    if not prompt_ids:
        raise ValueError("prompt is empty: at least one token is needed")
    limit = target.config.max_position_embeddings
    if drafter is not None and draft_tokenizer is None:  # a drafter of another vocabulary counts its own positions
        limit = min(limit, drafter.config.max_position_embeddings)
    if len(prompt_ids) + params.max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                         f"{len(prompt_ids) + params.max_tokens} exceeds the model's max_position_embeddings ({limit})")
    cfg = EngineConfig(model="(target in memory)", draft_model=None if drafter is None else "(drafter in memory)",
                       use_speculative_decoding=True, proposer=proposer, spec_length=spec_length,
                       draft_vocab_size=None, kv_cache_backend=kv_cache_backend, max_batch_size=1,
                       max_num_batched_tokens=max(512, len(prompt_ids)), compile=False, **spec_options)
    # room for the whole request and one round's lookahead (K_max drafts, or a tree's drafter entries)
    cfg.max_seq_len = min(limit, len(prompt_ids) + params.max_tokens + cfg.max_spec_length)
    engine = Engine(cfg, model=target, draft_model=drafter, tokenizer=tokenizer, draft_vocab=draft_vocab,
                    draft_tokenizer=draft_tokenizer)
    stats = SpecStats()
    printer = _make_printer(debug, tokenizer)

    def on_round(record: RoundRecord, request: Request) -> None:
        stats.record(record)
        if printer:
            printer(record, request)

    engine.decoder.on_round = on_round
    eos = target.config.eos_token_ids if eos_token_ids is None else eos_token_ids
    req = engine.add_request(list(prompt_ids), params, generator=generator, eos_token_ids=eos)
    engine.run([req])
    from .spec_decode.debug import RoundPrinter

    if isinstance(printer, RoundPrinter):
        printer.finish()  # says so where no round ran
    return req, stats


def _make_printer(debug, tokenizer):
    if not debug:
        return None
    if callable(debug):
        return debug
    from .spec_decode.debug import RoundPrinter

    return RoundPrinter(tokenizer)
