"""speculative_generate: the library-level draft -> verify -> reject -> roll back loop for one sequence.

Cache invariant between rounds: with the sequence x_0..x_{L-1}, the target's cache holds x_0..x_{L-2} (the last
token g = x_{L-1} has not been fed). A round:

  draft   drafter is fed seq[n_d:L] (normally just g; after a bonus also the unfed t_K), then t_1..t_{K-1};
          q_k = pipeline(drafter logits) and t_{k+1} ~ q_k                              # K drafter forwards
  verify  target is fed [g, t_1, .., t_K] at positions L-1 .. L+K-1 -> p_0 .. p_K         # one target forward
  accept  spec.verify: n accepted drafts + one recovered (n < K) or bonus (n == K) token
  rollback both caches truncate to L+n (lengths only); the drafter catches up on t_K lazily next round

Both q and p come from the same sampling pipeline with the same growing context (repetition penalty at draft
position k sees the context plus t_1..t_k), so every emitted token is distributed exactly as autoregressive
sampling from the target (Leviathan et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import SlottedKVCache
from ..generate import check_fits
from ..model.llama import LlamaForCausalLM
from ..request import Request
from ..sampling import SamplingBatch, SamplingParams, argmax, logits_to_probs, make_generator, sample, seen_mask
from ..tokenizer import Tokenizer
from .adaptive import EntropyAdaptiveGamma
from .draft_vocab import DraftVocab
from .verify import verify


def check_compatible(target: LlamaForCausalLM, drafter: LlamaForCausalLM, target_name="target",
                     drafter_name="drafter") -> None:
    tv, dv = target.config.vocab_size, drafter.config.vocab_size
    if tv != dv:
        raise ValueError(f"drafter {drafter_name} has vocab_size {dv} but target {target_name} has {tv}: "
                         "speculative decoding needs one shared vocabulary")


class _Stream:
    """One model's view of the sequence: how many tokens it has consumed, with or without a KV cache."""

    def __init__(self, model: LlamaForCausalLM, use_cache: bool, capacity: int, head=None):
        self.model, self.use_cache = model, use_cache
        self.head = head or model.compute_logits  # hidden [T, H] -> float32 logits [T, V] (or [T, N] over a subset)
        self.kv = SlottedKVCache.for_model(model, capacity) if use_cache else None
        self.slot = self.kv.allocate() if use_cache else None
        self.fed: list[int] = []  # tokens whose K/V are (logically) cached

    def feed(self, tokens: list[int], last: int) -> torch.Tensor:
        """Consume ``tokens``; return float32 logits [last, V] (the head's width) for the final ``last`` of them."""
        device = self.model.device
        if self.use_cache:
            meta = self.kv.prepare([self.slot], [len(tokens)])
            hidden = self.model(torch.tensor([tokens], device=device), meta.positions, self.kv, meta)
        else:  # recompute everything (use_cache=False), as the reference design allows
            hidden = self.model(torch.tensor([self.fed + tokens], device=device))
        self.fed += tokens
        return self.head(hidden[0, -last:])

    def truncate(self, n: int) -> None:
        del self.fed[n:]
        if self.use_cache:
            self.kv.truncate_to(self.slot, n)


@dataclass
class RoundRecord:
    k: int  # drafts this round
    drafted: list[int]
    num_accepted: int
    emitted: list[int]  # tokens actually appended (stops may cut the accepted run)
    bonus: bool  # final token was a bonus (all accepted) rather than recovered
    expected_accept: list[float]  # sum_x min(p, q) per draft position
    p_rejected: float | None = None  # p(t) and q(t) of the rejected draft
    q_rejected: float | None = None
    h_norm: float | None = None  # drafter's normalised entropy (EGAG)

    @property
    def tested(self) -> int:
        """Draft positions actually judged: up to and including the first rejection."""
        return min(self.num_accepted + 1, self.k)


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
    drafter: LlamaForCausalLM,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    gamma: int = 5,
    eos_token_ids: list[int] | None = None,
    tokenizer: Tokenizer | None = None,
    generator: torch.Generator | None = None,
    max_new_tokens: int | None = None,
    use_cache: bool = True,
    first_target: bool = True,
    skip_sample_adjustment: bool = False,
    debug: bool | callable = False,
    use_egag: bool = False,
    gamma_min: int = 1,
    gamma_max: int | None = None,
    egag_ema_beta: float = 0.0,
    request: Request | None = None,
    draft_vocab: DraftVocab | None = None,
) -> tuple[Request, SpecStats]:
    """Decode one sequence speculatively; returns the finished Request (tokens, text, counters) and SpecStats.

    ``gamma`` (K) drafts per round; with ``use_egag`` K adapts per round within [gamma_min, gamma_max] (default
    gamma_max = gamma). ``first_target`` samples the first token from the target's prefill (as the reference
    design does) before drafting starts. ``skip_sample_adjustment`` is a LOSSY debug switch: at a rejection it
    samples from p instead of norm(max(0, p - q)), so outputs no longer follow the target's distribution.
    ``debug``: True prints each round (colours on a TTY); a callable receives (RoundRecord, Request).
    ``draft_vocab``: the drafter scores only those tokens plus the prompt's (lossless; see spec.draft_vocab).
    """
    params = params or SamplingParams()
    if max_new_tokens is not None:
        params = SamplingParams(**{**params.__dict__, "max_tokens": max_new_tokens})
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma (spec_length K) must be an integer >= 1, got {gamma!r}")
    check_compatible(target, drafter)
    check_fits(target, len(prompt_ids), params.max_tokens)
    egag = EntropyAdaptiveGamma(gamma_min, gamma if gamma_max is None else gamma_max, egag_ema_beta) if use_egag else None
    eos = target.config.eos_token_ids if eos_token_ids is None else eos_token_ids
    if generator is None and not params.greedy:
        generator = make_generator(params.seed, target.device)
    req = request or Request(prompt_ids, params, eos, tokenizer, generator)
    V, device = target.config.vocab_size, target.device
    batch = SamplingBatch.from_params([params], V, device)
    seen = seen_mask([prompt_ids], V, device) if batch.use_penalty else None  # [1, V], grows with the output
    capacity = len(prompt_ids) + params.max_tokens + 1
    if draft_vocab is not None and draft_vocab.vocab_size != drafter.config.vocab_size:
        raise ValueError(f"draft_vocab was built for a vocabulary of {draft_vocab.vocab_size} tokens, the drafter "
                         f"has {drafter.config.vocab_size}")
    dv = None if draft_vocab is None else draft_vocab.including(prompt_ids)
    tgt = _Stream(target, use_cache, capacity)
    dft = _Stream(drafter, use_cache, capacity, head=None if dv is None else dv.logits)
    stats = SpecStats()
    printer = _make_printer(debug, tokenizer)
    seq = list(prompt_ids)
    fast_greedy = params.greedy and not batch.use_penalty  # argmax in, argmax out: no probability tensors

    def emit(tokens: list[int]) -> list[int]:
        done = []
        for t in tokens:
            done.append(t)
            if seen is not None:
                seen[0, t] = True
            seq.append(t)
            if req.append(t):
                break
        return done

    def target_step() -> None:
        """One plain target forward over the unfed tokens and one sampled token (no drafting)."""
        probs = logits_to_probs(tgt.feed(seq[len(tgt.fed):], 1), batch, seen)
        req.num_target_forwards += 1
        emit(sample(probs, [generator], [params.greedy]).tolist())

    try:
        if first_target:  # prefill the target and take the first token from it
            target_step()
        while not req.finished:
            remaining = params.max_tokens - len(req.output_ids)
            k = min(egag.next_gamma() if egag else gamma, remaining - 1)  # a round emits up to K+1 tokens
            L = len(seq)
            if k == 0:  # one token left: a plain target step
                target_step()
                break
            # -- draft: K drafter forwards; the first also catches up on any unfed tokens ------------------
            drafts, q_rows, draft_logits = [], [], []
            ctx_seen = None if seen is None else seen.clone()
            pending = seq[len(dft.fed):]
            for _ in range(k):
                logits = dft.feed(pending, 1)  # [1, V], or [1, N] over the draft vocabulary
                if fast_greedy:  # argmax needs no probabilities
                    t = int(argmax(logits)) if dv is None else dv.id_list[int(argmax(logits))]
                    if egag:
                        draft_logits.append(logits[0] if dv is None else dv.expand(logits[0]))
                else:
                    if dv is not None:
                        logits = dv.expand(logits)  # [1, V], -inf outside: q(x) = 0 there
                    q = logits_to_probs(logits, batch, ctx_seen)
                    t = int(sample(q, [generator], [params.greedy]))
                    q_rows.append(q[0])
                    if egag:
                        draft_logits.append(logits[0])
                drafts.append(t)
                if ctx_seen is not None:
                    ctx_seen[0, t] = True
                pending = [t]
            # -- verify: one target forward over [unfed..., g, t_1..t_K] ------------------------------------
            p_logits = tgt.feed(seq[len(tgt.fed):] + drafts, k + 1)  # [K+1, V]
            req.num_target_forwards += 1
            if fast_greedy:
                # One host sync for K+1 ints; then greedy_verify's rule (accept while the target's argmax equals
                # the draft, then emit the target's argmax) costs less in Python than K tiny tensor ops.
                top = argmax(p_logits).tolist()  # [K+1]
                n = 0
                while n < k and top[n] == drafts[n]:
                    n += 1
                new, bonus = drafts[:n] + [top[n]], n == k
                # one-hot p and q: sum_x min(p, q) = p(t) = 1 exactly when the target's argmax is the draft
                expected, p_rej, q_rej = [float(a == d) for a, d in zip(top, drafts)], 0.0, 1.0
            else:
                draft_t = torch.tensor([drafts], device=device)
                p_seen = None
                if seen is not None:  # position j sees the context plus t_1..t_j
                    grow = torch.zeros(k + 1, V, dtype=torch.bool, device=device)
                    grow[1:] = torch.nn.functional.one_hot(draft_t[0], V).cumsum(0).bool()
                    p_seen = seen | grow
                p = logits_to_probs(p_logits, batch.expand(k + 1), p_seen)
                res = verify(draft_t, torch.stack(q_rows)[None], p[None], [generator], [params.greedy],
                             skip_sample_adjustment=skip_sample_adjustment)
                n = int(res.num_accepted[0])
                new, bonus = res.output_tokens[0, : n + 1].tolist(), bool(res.is_bonus[0])
                expected = res.expected_accept[0].tolist()
                p_rej, q_rej = (float(res.p_draft[0, n]), float(res.q_draft[0, n])) if n < k else (None, None)
            # -- rollback: keep g and the n accepted drafts in both caches ---------------------------------
            tgt.truncate(L + n)
            dft.truncate(min(L + n, len(dft.fed)))
            req.num_draft_tokens += k
            req.num_accepted_tokens += n
            record = RoundRecord(k, drafts, n, emit(new), bonus, expected)
            if n < k:
                record.p_rejected, record.q_rejected = p_rej, q_rej
            if egag:
                record.h_norm = egag.observe(torch.stack(draft_logits))
            stats.record(record)
            if printer:
                printer(record, req)
    finally:
        for s in (tgt, dft):
            if s.kv is not None:
                s.kv.free(s.slot)
    return req, stats


def _make_printer(debug, tokenizer):
    if not debug:
        return None
    if callable(debug):
        return debug
    from .debug import RoundPrinter

    return RoundPrinter(tokenizer)
