"""The proposer seam: whatever guesses the next K tokens of each request (a draft model, n-gram lookup, ...).

    proposal = proposer.propose(DraftBatch(reqs, ks, sampling, seen, generators, vocab_size, device))
    proposal.drafts      [B, K] long   row b's guesses in drafts[b, :num_draft[b]], K = max(ks)
    proposal.num_draft   [B]           <= ks[b]: a proposer may guess fewer (an n-gram with no match: none)
    proposal.q           [B, K, V] or None: the distribution each draft was drawn from; None means every draft is
                                       deterministic (q = one-hot on it), which verification handles exactly
                                       (a drafter's q over a draft vocabulary is kept so, ``q_sub``, and built
                                       into [B, K, V] when ``q`` is first read)
    proposal.logits      [B, K, V] or None: raw draft logits, only when ``keep_logits`` (EGAG, debug)
    proposal.free        [B] bool or None: rows whose drafts cost no model step (copies from the context)
    proposal.confidence  [B, K] float32 or None: only when ``batch.confidence``: the drafter's probability of each
                                       model draft given those before it (q(t_j) as drawn; a greedy draft's own
                                       softmax at temperature 1), NaN where a row has none (copies, no draft)
    proposal.first_s, steps_s, model_rows, model_steps: what the drafter's model steps took (the cost model)

Invariants every proposer keeps (the round relies on them for losslessness):
- drafts are a function of the request's tokens (``Request.all_ids()``), the target's hidden states at them (handed
  over by the runner to proposers with ``uses_features``), the proposer's own models and each row's generator only;
  a proposer never touches the target's KV cache;
- where q is given, q[b, j] is computed with the row's sampling pipeline (``logits_to_probs`` with the same
  params as the target, the penalty context grown by drafts[b, :j], and a structured-output row's grammar mask at
  position j: ``batch.grammar``, which DraftDrawer applies) and drafts[b, j] is a draw from it;
- a tree (``propose_tree``, proposers with ``supports_tree``) holds deterministic candidates: a function of the
  same inputs, never of a row's generator, so verification follows the matching child exactly (spec_decode.tree);
- state a proposer keeps per request (a draft KV slot, an n-gram index) describes tokens of the sequence only,
  never unaccepted drafts: the round rolls the draft KV back with the target's (KVManager.rollback).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..request import Request
from ..sampling import SamplingBatch, argmax, logits_to_probs, sample
from ..spec_decode.tree import DraftTree
from ..spec_decode.verify import over_vocab

if TYPE_CHECKING:
    from ..spec_decode.grammar import RoundGrammar


@dataclass
class DraftStop:
    """A lone row's round whose length the drafter's confidence sets (auto K: GoodputSpecLength.stop): up to ``cap``
    drafts, ending before draft j + 1 where the chance that drafts 1 .. j are all accepted, the product of ``cal`` at
    their confidences' bins, is under below[j - 1]. Lossless: whether a step runs depends on the drafts before it
    alone, and every draft drawn is judged (kernels/eagle_round.cpp). A proposer that cannot stop early drafts
    ``ks``."""

    cap: int
    cal: torch.Tensor  # [bins] float32: acceptance of drafts by confidence bin (equal bins over [0, 1])
    below: torch.Tensor  # [cap - 1] float32: what draft j + 1 must be worth (the chance before it) to be drawn


@dataclass
class DraftBatch:
    """One round's decode requests as a proposer sees them."""

    reqs: list[Request]
    ks: list[int]  # drafts asked of each row (0: none)
    sampling: SamplingBatch | None  # None: every row greedy, no penalty or bias (argmax drafting, q not needed)
    seen: torch.Tensor | None  # [B, V] the rows' penalty contexts (sampling.penalty_context), when a penalty is on
    generators: list[torch.Generator | None]
    vocab_size: int
    device: torch.device
    keep_logits: bool = False
    grammar: RoundGrammar | None = None  # structured output: the round's masks, which model drafters draw under
    confidence: bool = False  # keep each model draft's probability (Proposal.confidence: auto K's cut, the round)
    stop: DraftStop | None = None  # a lone row's round drafted by confidence, up to stop.cap (else ks)

    @property
    def K(self) -> int:
        return max(self.ks)


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, K] long
    num_draft: list[int]  # [B]
    q: torch.Tensor | None = None  # [B, K, V] (a property, below: given over a draft vocabulary, built when read)
    logits: torch.Tensor | None = None  # [B, K, V]
    confidence: torch.Tensor | None = None  # [B, K] float32, NaN where none (module docstring)
    catch_up: int = 0  # most tokens a row brought to the batched first draft step (beyond K + 1: some catching up)
    catch_up_tokens: int = 0  # tokens fed to the proposer's model alone, before drafting (lazy prefills)
    catch_up_s: float = 0.0  # and the seconds they took (not a draft step's cost)
    free: list[bool] | None = None  # rows drafted at no model cost (n-gram copies): their acceptance is kept apart
    # the model's draft steps, for the cost model: rows in its first step, steps run, seconds of the first step (with
    # the round's set-up, less the lone catch-up above; with the steps run in the same call, EagleHead.draft_round)
    # and of the later steps together (the cost model prices their sum: CostModel.draft_cost)
    model_rows: int = 0
    model_steps: int = 0
    first_s: float = 0.0
    steps_s: float = 0.0
    # q as a drafter drew it over a draft vocabulary: (q [B, K, N], the vocabulary's token ids [N]), 0
    # outside them; ``q`` is this scattered into [B, K, V] when first read (~0.1 ms of a SmolLM2 round at 0.7: a
    # [1, 4, 49,152] tensor zeroed and written), which a sampled verify reading q where it needs it never does
    # (``q_over_draft_vocab``: spec_decode.verify.rejection_sample_tempered)
    q_sub: tuple[torch.Tensor, torch.Tensor] | None = None
    vocab_size: int = 0  # V, with q_sub

    @property
    def has_q(self) -> bool:
        """Whether the drafts were drawn from a q (False: deterministic), without building q."""
        return self._q is not None or self.q_sub is not None

    def q_over_draft_vocab(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [B, K, N], ids [N]) where q is given over a draft vocabulary and not built yet, else None."""
        return self.q_sub if self._q is None else None


def _get_q(self: Proposal) -> torch.Tensor | None:
    if self._q is None and self.q_sub is not None:
        self._q = over_vocab(*self.q_sub, self.vocab_size)
    return self._q


def _set_q(self: Proposal, value: torch.Tensor | None) -> None:
    self._q = value


Proposal.q = property(_get_q, _set_q)  # after @dataclass: __init__ assigns q through the setter


Offer = tuple[int, "list[float] | None", int]  # (free drafts, their confidences, confidence group): Proposer.offers


def row_offers(reqs, ks, free, confidence, group) -> list[Offer | None]:
    """``Proposer.offers`` row by row from the three per-row answers (callables like the proposer's methods)."""
    out: list[Offer | None] = []
    for r, k in zip(reqs, ks):
        n = free(r, k) if k > 0 else None
        out.append(None if n is None else (n, confidence(r, n), group(r, n)))
    return out


class Proposer(ABC):
    """Guesses continuations; see the module docstring for the invariants."""

    name = "?"
    uses_draft_model = False  # True: the KV manager keeps a draft pool in lockstep with the target's
    uses_features = False  # True: the runner hands over the target's hidden states (``observe``)
    supports_tree = False  # True: ``propose_tree`` drafts token trees

    @abstractmethod
    def propose(self, batch: DraftBatch) -> Proposal:
        """Up to ``batch.ks[b]`` drafts for each row."""

    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        """A tree per row (rooted at its last token), up to ``batch.ks[b]`` deep, ``width`` children kept a depth
        (spec_decode.tree.grow); a row that cannot draft gets its root alone. Before the cut to the node budget."""
        raise NotImplementedError(f"the {self.name} proposer drafts chains only")

    def free_drafts(self, req: Request, k: int) -> int | None:
        """How many drafts (<= k) ``req`` would get now at no model cost (an n-gram copy from its context); None when
        its drafts come from a model, priced by the cost model. Auto K prices and estimates such rows apart."""
        return None

    def draft_confidence(self, req: Request, k: int) -> list[float] | None:
        """For free drafts: the proposer's own probability of each of the drafts ``free_drafts(req, k)`` counted, given
        the drafts before it (a suffix tree's counts); None where it has no such estimate. Auto K learns how these
        map to acceptance and prices each row's drafts by them (a long run of confident copies is worth a long draft,
        which one acceptance rate per row cannot tell)."""
        return None

    def confidence_group(self, req: Request, k: int) -> int:
        """Which group the confidences of ``draft_confidence(req, k)`` belong to: auto K calibrates each group apart
        (the same probability may mean more from one kind of evidence than another: a suffix tree's long match
        against a one-token one). A small int; 0 where the proposer does not tell its confidences apart."""
        return 0

    def offers(self, reqs: list[Request], ks: list[int]) -> list[Offer | None]:
        """For each row with ``ks[b] > 0``: (``free_drafts``, ``draft_confidence`` of those, ``confidence_group``) at
        ``ks[b]``; None where its drafts come from a model or ``ks[b]`` is 0. Auto K asks every row every round: a
        proposer may answer for the batch at once (the suffix tree: one C++ call)."""
        return row_offers(reqs, ks, self.free_drafts, self.draft_confidence, self.confidence_group)

    # True: a row offered free drafts (``offers``) may be drafted by the proposer's model instead, where the caller
    # says so before ``propose`` (``decline``): a hybrid's copy or its draft model. Auto K prices such a row both ways.
    drafts_either_way = False

    def decline(self, req: Request) -> None:
        """This round, draft ``req`` with the model, not the free drafts offered (only with ``drafts_either_way``)."""
        raise NotImplementedError(f"the {self.name} proposer has one way to draft a row")

    def pending(self, req: Request) -> int:
        """Tokens of ``req`` the proposer must consume before it can draft, beyond an ordinary step's one or two
        (a draft model's lazy prefill of the prompt, or of the text decoded while the row sat at K = 0): a one-time
        cost of drafting for the row, which the goodput K policy weighs. 0 for proposers without a model."""
        return 0

    def finished(self, req: Request) -> None:
        """``req`` has finished (or was aborted): it will not be drafted for again (a proposer that learns across
        requests keeps its text; the others have nothing to do)."""

    def observe(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """The target's final-norm hidden states [n, H] at positions start .. start+n-1 of ``req`` (only with
        ``uses_features``; positions of rejected drafts are never handed over)."""

    # -- profiling (spec_length="auto" prices a draft step; proposers without a model cost ~nothing) -------------
    def scratch_fill(self, slots: list[int], n: int) -> None:
        """Give scratch draft-pool slots ``n`` tokens of context (only proposers that ``uses_draft_model``)."""

    def scratch_step(self, slots: list[int] | None, b: int) -> bool:
        """Run one draft step for ``b`` rows (on ``slots`` when the proposer keeps a draft pool), synced to the
        host; False when a draft step costs nothing worth timing."""
        return False

    def lone_round_native(self) -> bool:
        """Whether a lone row's round runs none of a compiled drafter's graphs (its whole round one C++ call), so it
        may draft at full speed while the engine's warm-up still builds them (SpeculativeDecoder.lone_ready). Only
        asked of a proposer whose drafter compiles (engine.warmup.Warmup.drafter)."""
        return False

    def warm_steps(self, pool, ctx: int, widths: list[int], rows: int = 1) -> None:
        """Run the draft steps of ``rows`` rows (after about ``ctx`` tokens of context; first steps of each of
        ``widths``) on ``pool``, a twin of the draft pool, so a compiled drafter's graphs exist before rounds draft
        (engine.warmup). Nothing for proposers without a model."""


class DraftDrawer:
    """Drafts from a drafter's hidden states, one position at a time, for rows of a DraftBatch: the argmax when the
    batch is greedy, else a draw from the row's sampling pipeline with q kept; over the draft vocabulary (``dv``,
    q = 0 outside it: lossless) when there is one. What every model-based proposer shares."""

    def __init__(self, batch: DraftBatch, head, dv=None):
        """``head``: hidden [n, H] -> float32 logits [n, V] (the full vocabulary; used without ``dv``)."""
        B, K, V, dev = len(batch.reqs), batch.K, batch.vocab_size, batch.device
        self.batch, self.head, self.dv = batch, head, dv
        # drafts [B, K] and conf [B, K] (NaN where none) are made when first written (the properties): a round whose
        # every draft one call drew (``put``: a lone row's C++ round) keeps that call's tensors, not copies of them
        self._drafts, self._conf = None, None
        # q [B, K, V] (0 outside a draft vocabulary), built when a draw needs it (the ``q`` property); drafts put by
        # a compiled round for every row keep theirs over the draft vocabulary alone (``q_sub``: Proposal.q_sub)
        self._q, self.q_sub = None, None
        self.logits = torch.zeros(B, K, V, device=dev) if batch.keep_logits else None
        self.ctx_seen = None if batch.seen is None else batch.seen.clone()
        # timing of the model steps (the cost model): from here (the proposer's set-up and catch-up are the first
        # step's), to the end of the first draw, to the end of the last
        self.t_start, self.t_first, self.t_last, self.rows, self.steps = time.perf_counter(), 0.0, 0.0, 0, 0

    def draw(self, j: int, idx: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Draft position ``j`` of rows ``idx`` from their hidden states [n, H] -> the drafts [n].

        With a draft vocabulary S the sampling pipeline runs over S's N columns: it gives what it gives over the
        vocabulary with -inf outside S (temperature, top-k, top-p and min-p only ever see S's tokens; the penalty
        context is read at S's ids), at N/V of the cost; q is then scattered into [V] (0 outside S)."""
        try:
            return self._draw(j, idx, hidden)
        finally:
            self.t_last = time.perf_counter()
            self.steps = max(self.steps, j + 1)
            if j == 0:
                self.t_first, self.rows = self.t_last, len(idx)

    @property
    def drafts(self) -> torch.Tensor:
        """[B, K] long: the drafts drawn so far (0 where none)."""
        if self._drafts is None:
            self._drafts = torch.zeros(len(self.batch.reqs), self.batch.K, dtype=torch.long, device=self.batch.device)
        return self._drafts

    @property
    def conf(self) -> torch.Tensor | None:
        """[B, K] float32 where the batch asks for confidences (``DraftBatch.confidence``), NaN where none; else None."""
        if self._conf is None and self.batch.confidence:
            self._conf = torch.full((len(self.batch.reqs), self.batch.K), float("nan"), device=self.batch.device)
        return self._conf

    @property
    def q(self) -> torch.Tensor | None:
        """q [B, K, V] of a sampled batch (None: greedy), built from ``q_sub`` the first time it is needed."""
        if self._q is None and self.batch.sampling is not None:
            batch = self.batch
            self._q = torch.zeros(len(batch.reqs), batch.K, batch.vocab_size, device=batch.device) \
                if self.q_sub is None else over_vocab(self.q_sub, self.dv.ids, batch.vocab_size)
            self.q_sub = None
        return self._q

    def put(self, j: int, idx: list[int], drafts: torch.Tensor, q: torch.Tensor | None = None,
            conf: torch.Tensor | None = None) -> None:
        """Drafts of positions j .. j+m-1 of rows ``idx``, [n, m], drawn by the drafter itself (a chain of steps:
        EagleHead.draft_chain; from j = 0, a round's first steps: draft_round) over the draft vocabulary, with the
        law q [n, m, N] they were drawn from (a greedy batch's: softmax at temperature 1): what m calls of ``draw``
        would have kept, timing included. ``conf`` [n, m]: each draft's probability under q, where the call gave it
        (Eagle3Head.native_round), else read from q."""
        m = drafts.shape[1]
        every = len(idx) == len(self.batch.reqs)
        rows_t = None if every else torch.tensor(idx, device=self.batch.device)
        rows = slice(None) if every else rows_t
        # the whole round in one call (every row, every position): its tensors are the round's (fresh outputs of the
        # call, never written again), not copied into zeros made for them
        whole = every and j == 0 and m == self.batch.K and self._drafts is None and drafts.dtype == torch.long
        if whole:
            self._drafts = drafts
        else:
            self.drafts[rows, j:j + m] = drafts
        if self.batch.sampling is not None:
            if every and self._q is None and self.conf is None:  # kept over S: Proposal.q_sub
                if j == 0 and m == self.batch.K:
                    self.q_sub = q
                else:
                    if self.q_sub is None:
                        self.q_sub = q.new_zeros(q.shape[0], self.batch.K, q.shape[2])
                    self.q_sub[:, j:j + m] = q
            elif every:  # one scatter for the m positions: 37 against 183 us at m = 4
                self.q[:, j:j + m].scatter_(2, self.dv.ids.expand(*q.shape), q)  # over SmolLM2's 49,152 (m index_puts)
            else:
                for i in range(m):
                    self.q[rows_t[:, None], j + i, self.dv.ids] = q[:, i]
        if self.batch.confidence:  # a greedy draft is its law's argmax; a drawn one is read back from the scattered q
            if whole and self._conf is None and self.batch.sampling is None:  # a greedy draft's: q's largest
                self._conf = conf if conf is not None else q.amax(-1).float()
            else:
                self.conf[rows, j:j + m] = q.amax(-1) if self.q is None else \
                    self.q[rows, j:j + m].gather(2, drafts[..., None])[..., 0]
        self.t_last = time.perf_counter()
        self.steps = max(self.steps, j + m)
        if j == 0:  # the round's first step ran in the same call (EagleHead.draft_round): its time is the first's
            self.t_first, self.rows = self.t_last, len(idx)

    def _draw(self, j: int, idx: list[int], hidden: torch.Tensor) -> torch.Tensor:
        batch, dv, sampling = self.batch, self.dv, self.batch.sampling
        # the rows as an index tensor; not needed where every row draws and nothing else is kept (greedy)
        rows_t = None if sampling is None and len(idx) == len(batch.reqs) and self.logits is None else \
            torch.tensor(idx, device=batch.device)
        if dv is None:
            logits = self.head(hidden)  # [n, V]
        else:
            logits = dv.logits(hidden)  # [n, N]
            if self.logits is not None:
                self.logits[rows_t, j] = dv.expand(logits)
        grammar = batch.grammar
        if grammar is not None:  # structured output: q has no mass where the grammar forbids a token
            reqs = [batch.reqs[b] for b in idx]
            logits = grammar.restrict(j, reqs, logits, None if dv is None else dv.ids)
        if sampling is None:  # greedy: argmax needs no probabilities (its confidence: the softmax's largest)
            drafts = argmax(logits)
            if self.conf is not None:
                self.conf[rows_t if len(idx) < len(batch.reqs) else slice(None), j] = \
                    torch.exp(logits.max(-1).values - logits.logsumexp(-1))
            drafts = drafts if dv is None else dv.token(drafts)
            self.drafts[rows_t if len(idx) < len(batch.reqs) else slice(None), j] = drafts
            if grammar is not None:
                grammar.push(j, reqs, drafts)
            return drafts
        if dv is None and self.logits is not None:
            self.logits[rows_t, j] = logits
        sub = sampling if len(idx) == len(batch.reqs) else SamplingBatch.from_params(
            [sampling.rows[b] for b in idx], batch.vocab_size, batch.device)
        seen = None if self.ctx_seen is None else self.ctx_seen[rows_t]
        if seen is not None and dv is not None:
            seen = seen[:, dv.ids]
        probs = logits_to_probs(logits, sub if dv is None else sub.over(dv.ids), seen)  # [n, V] or [n, N]
        drawn = sample(probs, [batch.generators[b] for b in idx], [batch.reqs[b].params.greedy for b in idx])
        if dv is None:
            self.drafts[rows_t, j] = drawn
            self.q[rows_t, j] = probs
        else:
            self.drafts[rows_t, j] = dv.token(drawn)
            self.q[rows_t[:, None], j, dv.ids] = probs  # 0 outside S (a fresh tensor each proposal)
        if self.conf is not None:
            self.conf[rows_t, j] = probs.gather(1, drawn[:, None])[:, 0]
        if self.ctx_seen is not None:  # the penalty context of draft j+1 includes draft j (once more)
            self.ctx_seen[rows_t, self.drafts[rows_t, j]] += 1
        if grammar is not None:
            grammar.push(j, reqs, self.drafts[rows_t, j])
        return self.drafts[rows_t, j]

    def proposal(self, num_draft: list[int], **kw) -> Proposal:
        """The drafts, with the model steps' timing (``catch_up_s``, a lone prefill, is not a step's cost)."""
        timing = {} if not self.steps else dict(
            model_rows=self.rows, model_steps=self.steps, steps_s=self.t_last - self.t_first,
            first_s=max(0.0, self.t_first - self.t_start - kw.get("catch_up_s", 0.0)))
        prop = Proposal(self.drafts, num_draft, self._q, self.logits, self.conf, **timing, **kw)  # made if unwritten
        if self._q is None and self.q_sub is not None:
            prop.q_sub, prop.vocab_size = (self.q_sub, self.dv.ids), self.batch.vocab_size
        return prop


def temperature_law_drafts(sampling: SamplingBatch) -> bool:
    """Every row samples, at a temperature and at most top-k / top-p / min-p (no penalty, no greedy row): a drafter
    may draw each row's drafts from q = softmax(logits / T), its plain temperature law, inside its compiled step,
    filters left out. Lossless all the same: any q is, when verification judges each draft by the q it was drawn
    from (accept with min(1, p / q), else draw from max(0, p - q)); the target's filtered p is 0 outside its top-k /
    top-p / min-p set, so a draft there is always rejected and the residual puts the mass back inside. What the
    filters' loss costs is acceptance (q's mass outside the set, ~1 - top_p where q is near p), against a
    data-dependent candidate search per draw that no compiled graph holds (sampling._top_k_top_p). A penalty
    reshapes p inside the set, so penalised rows keep drafting from their own pipeline, and so do biased ones."""
    return not (sampling.use_penalty or sampling.logit_bias is not None or any(p.greedy for p in sampling.rows))


_GREEDY_UNIFORMS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (rows, draws, device) -> greedy's zeros


def round_uniforms(batch: DraftBatch, idx: list[int], m: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(temperature [n], u [n, m] float64) of rows idx for m draws in one call (a compiled round, a one-call round in
    C++): each row's next m uniforms from its generator, what m single draws would take (greedy: zeros, nothing
    drawn)."""
    if batch.sampling is None:  # the same zeros every greedy round (read, never written: ~20 us of two cold ops)
        key = (len(idx), m, str(dev))
        if key not in _GREEDY_UNIFORMS:
            _GREEDY_UNIFORMS[key] = (torch.zeros(len(idx), device=dev),
                                     torch.zeros(len(idx), m, dtype=torch.float64, device=dev))
        return _GREEDY_UNIFORMS[key]
    if len(idx) == 1:  # a lone row's in one draw (the same stream): a round's host work runs cold, ~20 us an op
        b = idx[0]
        temp = batch.sampling.temperature if len(batch.reqs) == 1 else batch.sampling.temperature[idx]
        return temp, torch.rand((1, m), dtype=torch.float64, generator=batch.generators[b], device=dev)
    u = torch.stack([torch.rand((m,), dtype=torch.float64, generator=batch.generators[b], device=dev) for b in idx])
    return batch.sampling.temperature[idx], u


def score_synced(hidden: torch.Tensor, draft_vocab, compute_logits) -> None:
    """Score one draft position (over the draft vocabulary when there is one) and sync to the host: how a draft
    step ends, for the profiling of ``scratch_step``."""
    (draft_vocab.logits if draft_vocab is not None else compute_logits)(hidden).max(-1).indices.tolist()


def one_hot_q(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q [B, K, V] of deterministic drafts: one-hot on each draft (entries past a row's num_draft are never judged)."""
    return torch.nn.functional.one_hot(drafts.clamp(min=0), vocab_size).float()
