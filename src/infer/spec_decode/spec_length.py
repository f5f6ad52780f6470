"""How many drafts (K) each request gets this round: pinned, goodput-optimal ("auto"), or entropy-adaptive (EGAG).

Any K schedule is lossless: K only trades draft and verify work against tokens per round. A policy answers

    ks = policy.choose(reqs, caps)        # K_b <= caps[b] for each decode request (0: plain decode for that row)
    policy.observe(req, k, n, logits, free)  # after the round: k drafted, n accepted (logits [k, V] for EGAG)
    policy.timed(B, T, s), policy.drafted(rows, steps, first_s, steps_s)  # what the round measured (cost model)

**Goodput K** (``spec_length="auto"``). Leviathan et al. (2023, section 3.3) choose K to maximise the walltime
improvement (1 - a^(K+1)) / ((1 - a)(K c + 1)); here the "1" (a verify costs one decode) is replaced by what the
machine measures. With B decode rows, row b at acceptance estimate a_b, the round's expected output is
sum_b E(a_b, K_b), E(a, k) = (1 - a^(k+1)) / (1 - a), and its cost is k draft steps at the batch size that drafts
plus one target forward over B x (k+1) tokens. The policy maximises tokens per second over k in 0..K_max and over
how many of the most promising rows draft (the rest take k = 0 inside the same verify pass); k drafts cost what
rounds of k model drafts measured (``CostModel.draft_cost``: the first step also carries the round's set-up, and a
compiled round's call costs more than its steps). k = 0 is plain decoding, so when a batch is large enough that
verifying (k+1) tokens per row costs more than it returns, K falls to 0 by itself. Costs come from ``CostModel``:
profiled once at start-up on the pools; every target forward then refits its batch size's line from profiled to
measured seconds (an offset and a slope). Also counted: each step's bookkeeping outside the forwards, and a row's
one-time catch-up (the drafter's lazy prefill, ``Proposer.pending``) amortised over the rounds
it will draft. A k > 0 must beat plain decoding by MARGIN.

a_b: accepted / judged drafts of the request (judged = up to the first rejection), counts decayed by 0.8 per round
so the estimate follows the text, shrunk toward the acceptance of all requests (weight 2 rounds) so a new request
starts from what the drafter usually achieves. A request whose estimate has sent it to k = 0 drafts once more
(k = 1) after ``PROBE_EVERY`` rounds, then twice as many, up to ``PROBE_MAX``, if speculation could pay at a high
acceptance, so it is not stuck at 0 when its text turns predictable.

Free drafts. A proposer that copies drafts from the context (prompt lookup; a hybrid's rows with an n-gram match:
``Proposer.free_drafts``) spends no model step on them: such a row is priced without draft steps, capped at the match's
length, and its acceptance is estimated apart from the model's (a copy is right far more often than a head's guess).

Either way. A hybrid (``Proposer.drafts_either_way``: a copier beside a draft model) can draft a row offered a copy
with its model instead. Such a row is priced both ways: the round is priced with every offered row copying, then with
every one drafting with the model, then (two or more such rows) with each row flipped from the better of the two; the
best round wins and the proposer is told which rows take the model's drafts (``decline``). Without it a row priced as
a copy only decoded plainly where its copy did not pay (a sampled row accepts a copy's token with p(t) only), though
the model's drawn drafts would have (suffix-hybrid at temperature 0.7: docs/benchmarks.md).

Confident free drafts. A proposer may also say how sure it is of each free draft (``Proposer.draft_confidence``: a
suffix tree's counts give the probability of each draft after the ones before it). Acceptance is then no longer one
rate per row: a row's curve is E(k) = 1 + sum_{j<=k} prod_{i<=j} c(p_i), where c maps the proposer's probability to
the acceptance measured for drafts of that probability (``Calibration``: ten bins, each an acceptance rate learnt
from every judged draft, starting from the bin's own probability). Copies inside a long repeated template are
priced as the long runs they are, and a draft that trails off into a rare branch is cut where it stops paying
(replayed on the JSON loop of benchmarks/suffix.py: 2.21x -> 2.26x over plain at K up to 8, code edit 1.66x ->
1.71x, against one rate per row). The proposer may also file its drafts in groups calibrated apart
(``Proposer.confidence_group``: a suffix tree's matched context, 1, 2, 3 or 4+ tokens: a share of the counts after
a one-token match says less than the same share after a long one; replayed figures in proposers/suffix.py).

Pricing pays for itself. Pricing a round costs Python time: at 8 rows of the suffix proposer ~0.3 ms, ~2% of a
step, where auto K answers k = 0 in almost every round (benchmarks/suffix.py, chat at 8 requests). Per batch size
the policy keeps two EMAs: what its answers are predicted to gain over plain decoding (in plain steps; 0 for a k = 0
answer) and what choose costs (its seconds over a plain step's price). Where the gain is the smaller, it prices one
round in 2, then in 4 (PRICE_EVERY_MAX), answering k = 0 unpriced in between; a priced answer that drafts by choice
brings back pricing every round (drafting chances come in runs). A skipped round loses what its answer would have
gained, and the EMA says that averages less than pricing it.

Exploration. The price of a draft step is only measured by rounds that draft; a price set too high (a stall while
it was measured, a profile stored on a busy machine) would keep every row at k = 0 for good. After EXPLORE_EVERY
rounds with no model draft step (doubled after each, up to EXPLORE_MAX), the most promising model row drafts two
tokens whatever the price, which re-measures a round of two drafts (~1% of the rounds, then less).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..proposers.base import DraftStop, row_offers
from .adaptive import EntropyAdaptiveGamma
from .cost_model import CostModel

DECAY = 0.8  # per-round decay of a request's acceptance counts
PRIOR_WEIGHT = 2.0  # judged drafts' worth of the global estimate in each request's estimate
# The same two for a request that samples (temperature > 0). A drawn draft is accepted by a coin of its own
# (min(1, p / q)), so a few rounds' outcomes say little about the next: at temperature 0.7 (SmolLM2, EAGLE-3 head)
# drafts judged after row estimates of 0.4 / 0.5 / 0.8 were accepted at 0.64-0.72 / 0.56-0.58 / 0.67-0.71, the
# engine's mean 0.61-0.65. With the greedy rows' memory (~5 rounds, worth 5x the prior) a short unlucky run sent a row
# to k = 0, where its estimate stays frozen until a probe (71% of the choices, at a median estimate of 0.43): a
# drawn row's estimate remembers ~30 rounds and trusts the engine's mean more (docs/benchmarks.md, "auto K at a
# temperature"). A row that keeps failing still reaches k = 0, after more rounds.
DRAWN_DECAY = 0.97
DRAWN_PRIOR_WEIGHT = 32.0
PROBE_EVERY = 16  # rounds at k = 0 before a request drafts once more; doubled after each probe that did not pay,
PROBE_MAX = 256  # up to this (a probe costs a verify slot and the drafter's catch-up on every token since the last)
ALPHA_CAP = 0.98  # E(a, k) is bounded by k + 1 anyway; this keeps 1 - a away from 0
# Speculate only where the predicted tokens/s beat plain decoding's by this fraction: a smaller predicted gain is
# within the cost model's error (its estimates of a round's parts are within a few percent, demo pair, 8 rows), and
# a loss there is a loss for every row of the batch. One request gains 15-50%; a full batch of the demo pair ~0-5%.
MARGIN = 0.08
# Pricing pays for itself: per batch size, an EMA (weight PRICE_EMA a priced round) of what choose's answers are
# predicted to gain over plain decoding (a fraction of a step: 0 where it answered k = 0) against what choose costs
# (its seconds over a plain step's price). Where the gain is smaller, choose answers k = 0 unpriced for up to
# PRICE_EVERY_MAX - 1 rounds in PRICE_EVERY_MAX (doubling from 1), and prices every round again once an answer drafts.
PRICE_EMA = 1 / 32
PRICE_EVERY_MAX = 4
EXPLORE_EVERY = 64  # rounds without a model draft step before one row drafts 2 anyway (re-pricing a draft step),
EXPLORE_MAX = 1024  # doubled after each exploration up to this; reset when a round drafts by choice


class Calibration:
    """The acceptance of a draft the proposer gave probability p (given the drafts before it), by bin of p: each bin
    an acceptance rate, counts decayed by ``decay`` per judged draft, starting as the bin's centre worth ``weight``
    drafts (a fresh engine trusts the proposer's counts until drafts are judged). One per confidence group."""

    def __init__(self, bins: int = 10, weight: float = 4.0, decay: float = 0.995):
        self.bins, self.decay = bins, decay
        self.accepted = [(i + 0.5) / bins * weight for i in range(bins)]
        self.judged = [weight] * bins

    def _bin(self, p: float) -> int:
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def __call__(self, p: float) -> float:
        i = self._bin(p)
        return self.accepted[i] / self.judged[i]

    def observe(self, p: float, accepted: bool) -> None:
        i = self._bin(p)
        self.accepted[i] = self.decay * self.accepted[i] + accepted
        self.judged[i] = self.decay * self.judged[i] + 1.0

    def curve(self, confidence: list[float], k_max: int) -> list[float]:
        """E[tokens a row emits] for k = 0..k_max drafts of these confidences (flat past the last draft)."""
        e, alive, top = [1.0], 1.0, self.bins - 1
        for p in confidence[:k_max]:  # self(p), inline: auto K prices every row every round
            i = min(top, max(0, int(p * self.bins)))
            alive *= self.accepted[i] / self.judged[i]
            e.append(e[-1] + alive)
        return e + [e[-1]] * (k_max + 1 - len(e))


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens a row emits in one round] = (1 - a^(k+1)) / (1 - a): accepted drafts + the recovered/bonus token."""
    a = min(alpha, ALPHA_CAP)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class FixedSpecLength:
    """``spec_length=K``: K drafts for every row, every round (capped by what the row has left)."""

    needs_logits = False
    cuts = cut_drawn = False  # every draft drafted is verified (auto K cuts them by confidence: GoodputSpecLength.cut)

    def cut(self, reqs, nd, confidence, free, sampled) -> list[int]:
        return nd

    def __init__(self, k: int):
        self.k = k

    def choose(self, reqs, caps: list[int]) -> list[int]:
        return [min(self.k, c) for c in caps]

    def observe(self, req, k: int, n: int, logits=None, free: bool = False) -> None:
        pass

    def timed(self, B: int, T: int, seconds: float) -> None:
        pass

    def drafted(self, rows: int, steps: int, first_s: float, steps_s: float) -> None:
        pass

    def round_overhead(self, B: int, spec: bool, seconds: float) -> None:
        pass

    def caught_up(self, tokens: int, seconds: float) -> None:
        pass


class EntropySpecLength(FixedSpecLength):
    """``spec_length="egag"``: each request's K from its drafter's entropy (spec_decode.adaptive)."""

    needs_logits = True

    def __init__(self, k_min: int, k_max: int, ema_beta: float):
        EntropyAdaptiveGamma(k_min, k_max, ema_beta)  # validates the bounds now
        self.k_min, self.k_max, self.ema_beta = k_min, k_max, ema_beta
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> EntropyAdaptiveGamma

    def _of(self, req) -> EntropyAdaptiveGamma:
        if req not in self.state:
            self.state[req] = EntropyAdaptiveGamma(self.k_min, self.k_max, self.ema_beta)
        return self.state[req]

    def choose(self, reqs, caps):
        return [min(self._of(r).next_gamma(), c) for r, c in zip(reqs, caps)]

    def observe(self, req, k, n, logits=None, free=False):
        """Returns the round's normalised drafter entropy (for the debug view)."""
        return self._of(req).observe(logits) if logits is not None and k else None


@dataclass
class _Acceptance:
    accepted: float = 0.0  # the model's drafts
    judged: float = 0.0
    free_accepted: float = 0.0  # free drafts (n-gram copies), counted apart
    free_judged: float = 0.0
    rounds_at_zero: int = 0
    probe_every: int = PROBE_EVERY
    confidence: list[float] | None = None  # this round's free drafts' confidences, if the proposer gave them
    group: int = 0  # and their confidence group (Proposer.confidence_group)
    drafted: list[float] | None = None  # this round's model drafts' confidences, as ``cut`` kept them
    # the request samples (temperature > 0): its drafts are drawn (calibrated apart from greedy ones) and its model
    # estimate is DRAWN_DECAY / DRAWN_PRIOR_WEIGHT's
    drawn: bool = False


@dataclass
class _Pricing:
    # EMAs of a priced round's predicted gain over plain decoding, in plain steps (from 0.1: ~50 priced rounds
    # that never draft before a typical cost, ~0.02, exceeds it), and of choose's seconds over a plain step's price
    gain: float = 0.1
    cost: float = 0.0
    every: int = 1  # price one round in `every`
    skipped: int = 0  # rounds answered unpriced since the last priced one


class _Sheet:
    """A round's prices for one batch size, read off the cost model once for every pricing of one ``choose`` (a row
    offered a copy is priced copying and drafting, and each pricing read the verify widths' line and fitted the
    measured draft rounds' line again): the verify of T = 0 .. k_max + 1 tokens a row, and per number of drafting
    model rows, its drafts' price at k = 0 .. k_max (filled when first needed)."""

    __slots__ = ("B", "verify", "drafts")

    def __init__(self, costs: CostModel, B: int, k_max: int):
        self.B, self.verify, self.drafts = B, costs.verify_costs(B, k_max + 1), {}


class GoodputSpecLength:
    """``spec_length="auto"``: per round, the K per request that maximises expected tokens per second, and, once
    drafted, the prefix of each row's drafts worth verifying (``cut``)."""

    needs_logits = False

    def __init__(self, k_max: int, costs: CostModel | None):
        self.k_max, self.costs = k_max, costs
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> _Acceptance
        # prior: a = 0.6, worth 10 judged drafts: one rejected probe moves it to 0.55, not 0.4 (with the prior worth 2,
        # a single early rejection sent every request of a sampled workload to k = 0 for good)
        self.global_accepted, self.global_judged = 6.0, 10.0
        self.global_free_accepted, self.global_free_judged = 6.0, 10.0  # the same prior for free drafts
        # per-row answers as Proposer.free_drafts, draft_confidence and confidence_group give them (none by default)
        self.free = lambda req, k: None
        self.confidence = lambda req, k: None
        self.group = lambda req, k: 0
        # the three for every row at once: setup wires the proposer's Proposer.offers; else from the three above
        self.offers = lambda reqs, caps: row_offers(reqs, caps, self.free, self.confidence, self.group)
        # a proposer that drafts a row either way (Proposer.drafts_either_way): its ``decline``, called for the rows
        # offered a copy that are priced higher with the model's drafts; None: an offered row copies
        self.decline = None
        self.dual = True  # False: offered rows copy whatever the model's drafts are worth (benchmarks' A/B)
        self.calibrations: defaultdict[int, Calibration] = defaultdict(Calibration)  # confidence group -> its own
        self.calibration = self.calibrations[0]  # group 0's
        # rounds since a model draft step was last timed, and after how many an exploration round drafts anyway
        self.unpriced, self.explore_every = 0, EXPLORE_EVERY
        self.last_choice: tuple[int, int] | None = None  # (k, rows drafting) of the last round, for tests and stats
        self.pending = lambda req: 0  # the proposer's Proposer.pending: tokens a row must catch up before drafting
        # rounds the decode batch has kept its size since it last shrank (0: it grew since): how far set-up costs may
        # be amortised. A batch that just lost a row often regains one next round (its replacement was prefilling):
        # a row that drafts only while the batch is small would pay its whole catch-up for a round or two.
        self.last_size, self.rounds_at_size = 0, 0
        # seconds a step spends outside the timed forwards (sampling set-up, verification, rollback, emission), per
        # (batch size, speculative?): a round's bookkeeping costs more than a plain step's, most under load
        self.overhead: dict[tuple[int, bool], float] = {}
        self.pricing: dict[int, _Pricing] = {}  # batch size -> whether choose's answers pay for its own time
        self.sheet: _Sheet | None = None  # the last choose's prices, until the round's cut reads them
        self.price_every_max = PRICE_EVERY_MAX  # 1: price every round (benchmarks' A/B of the back-off)
        # the cut of a round's model drafts by their confidence (``cut``): acceptance by the drafter's probability,
        # greedy drafts (False) and drawn ones (True) apart; ``cuts`` False verifies every draft (benchmarks' A/B)
        self.cuts = True
        self.cut_drawn = False  # True: drawn rows cut by their drafts' own q(t) as well, a LOSSY variant (``cut``)
        self.draft_calibrations = {False: Calibration(), True: Calibration()}
        # a lone model row's round drafted by the drafter's confidence, up to its cap (``stop``); False: the K chosen
        # (benchmarks' A/B)
        self.stops = True
        self.last_rate = 0.0  # the last priced round's predicted tokens a second (``stop`` prices a draft by it)

    def alpha(self, req, free: bool = False) -> float:
        return self._alpha(self.state.get(req) or _Acceptance(drawn=not req.params.greedy), free)

    def _state(self, req) -> _Acceptance:
        s = self.state.get(req)
        if s is None:
            s = self.state[req] = _Acceptance(drawn=not req.params.greedy)
        return s

    def _alpha(self, s: _Acceptance, free: bool) -> float:
        if free:
            a_global = self.global_free_accepted / self.global_free_judged
            return (s.free_accepted + PRIOR_WEIGHT * a_global) / (s.free_judged + PRIOR_WEIGHT)
        a_global = self.global_accepted / self.global_judged
        w = DRAWN_PRIOR_WEIGHT if s.drawn else PRIOR_WEIGHT
        return (s.accepted + w * a_global) / (s.judged + w)

    def _best(self, alphas: list[float], caps: list[int], setup: list[tuple[float, int]] | None = None,
              horizon: int = 1 << 30, free: list[bool] | None = None,
              curves: list[list[float] | None] | None = None, sheet: _Sheet | None = None) -> tuple[float, int, int]:
        """(tokens/s, k, m): the m most promising rows draft k (<= their caps), the others 0; k = 0 (plain decoding,
        its tokens/s raised by MARGIN) unless some k beats it. Rows with ``free[b]`` draft without model steps.
        ``curves[b]``, where given, is row b's expected tokens at k = 0..k_max (confident free drafts), in place of
        E(alphas[b], k).

        ``setup[b]`` = (seconds, tokens left): a one-time cost row b pays when it starts drafting (its drafter's lazy
        prefill of what it has not seen), spread over the rounds it will draft: its rounds left at that k (tokens
        left / E(a, k)), but at most ``horizon``. A row about to finish does not start drafting, and neither does a
        row whose batch has just shrunk and may grow back (its neighbour's replacement prefilling for a step).

        ``sheet``: the round's prices read once for every pricing of one ``choose`` (else read here)."""
        B = len(alphas)
        plain_o, spec_o = self.overhead.get((B, False), 0.0), self.overhead.get((B, True), 0.0)
        k_top = min(self.k_max, max(caps, default=0))
        sheet = sheet if sheet is not None and sheet.B == B else _Sheet(self.costs, B, self.k_max)
        verify = sheet.verify  # [T = 0 .. k_max + 1]; this pricing reads T <= k_top + 1
        best = (B / (verify[1] + plain_o) * (1.0 + MARGIN), 0, 0)
        # No k can beat plain decoding if even the most each row could add (its expected tokens at its cap: a curve and
        # E(a, k) only grow with k), over the cheapest verify alone (no draft steps, no set-up), does not: the answer
        # without the search. At 8 rows auto K prices almost every draft out, and the search over k and m was most of
        # choose (~0.1 ms a step); a lone row answered k = 0 (a third of greedy steps) is priced cold every step, so
        # the bound reads one value a row, not its whole curve. An upper bound: the search finds the same answer.
        top = sum((curves[b][min(caps[b], len(curves[b]) - 1)] if curves is not None and curves[b] is not None else
                   expected_tokens(alphas[b], min(caps[b], self.k_max))) - 1.0 for b in range(B) if caps[b])
        if (B + top) / (min(verify[1:k_top + 2]) + spec_o) <= best[0]:
            return best
        order = self._order(alphas, caps)
        # per row that can draft, in `order`: E(a, j) for j = 0..k_max (the row's cap bounds j), its set-up seconds
        # and tokens left, whether its drafts are free. A row of cap 0 adds no token and no cost at any k: it never
        # changes the best rate, and `order` puts such rows last, so they are left out.
        e_rows = [(curves[b] if curves is not None and curves[b] is not None else
                   [expected_tokens(alphas[b], j) for j in range(self.k_max + 1)], caps[b],
                   *(setup[b] if setup is not None else (0.0, 1)), bool(free and free[b]))
                  for b in order if caps[b]]
        # k past every cap verifies no more drafts than k = max(caps) and would be priced as wider than it is
        draft_s = sheet.drafts  # n model rows -> a round's drafts over them at k = 0 .. k_max, priced when first needed
        for k in range(1, k_top + 1):
            total, setup_s, models, drafts = float(B), 0.0, 0, 0
            for m, (e, cap, once, left, is_free) in enumerate(e_rows, 1):
                x = e[min(k, cap)]
                total += x - 1.0  # extra tokens of the m-th drafting row
                # the verify: B rows and the m drafting rows' drafts, B x t real tokens (the other rows' pads are
                # skipped: kernels/rows.h), between the profiled widths around t
                drafts += min(k, cap)
                t = 1.0 + drafts / B
                lo = int(t)
                fixed = (verify[lo] if lo == t else verify[lo] + (t - lo) * (verify[lo + 1] - verify[lo])) + spec_o
                models += not is_free
                if once and not is_free:  # its set-up seconds, amortised over min(its rounds left, horizon)
                    setup_s += once * max(x / max(x, left), 1.0 / horizon)
                if models not in draft_s:
                    draft_s[models] = self.costs.draft_costs(models, self.k_max)
                rate = total / (fixed + draft_s[models][k] + setup_s)
                if rate > best[0]:
                    best = (rate, k, m)
        return best

    def _price(self, free: list[bool], copy: list, model: list, horizon: int, sheet: _Sheet | None = None) -> tuple:
        """The best round (``_best``) with row b copying where ``free[b]`` (priced by ``copy[b]``), else drafting with
        the model (``model[b]``) -> (tokens/s, k, m, free, and the per-row estimates, caps, confidences and groups
        it was priced by)."""
        rows = [copy[b] if f else model[b] for b, f in enumerate(free)]
        alphas, caps, confidence, groups, curves, setup = (list(x) for x in zip(*rows))
        # no row has a draft to offer (a copying proposer found no match anywhere): plain decoding, nothing to price
        rate, k, m = self._best(alphas, caps, setup, horizon, free, curves, sheet) if any(caps) else (0.0, 0, 0)
        return rate, k, m, free, alphas, caps, confidence, groups

    @staticmethod
    def _order(alphas: list[float], caps: list[int]) -> list[int]:
        """The rows in the order they start drafting: the rows that can (cap > 0) by acceptance estimate, then the
        rest."""
        return sorted(range(len(alphas)), key=lambda b: (not caps[b], -alphas[b]))

    def choose(self, reqs, caps):
        B = len(reqs)
        pricing = self.pricing.get(B)
        if pricing is None:
            pricing = self.pricing[B] = _Pricing()
        if pricing.skipped + 1 < pricing.every:  # its answers here have not paid for its time: k = 0, unpriced
            pricing.skipped += 1
            self.last_choice, self.sheet = (0, 0), None
            return [0] * B
        t0 = time.perf_counter()
        sheet = self.sheet = _Sheet(self.costs, B, self.k_max)  # ``cut`` reads the round's prices from it too
        ks, gain = self._choose(reqs, caps, sheet)
        step = sheet.verify[1] + self.overhead.get((B, False), 0.0)
        pricing.gain += PRICE_EMA * (gain - pricing.gain)
        pricing.cost += PRICE_EMA * ((time.perf_counter() - t0) / max(step, 1e-9) - pricing.cost)
        pricing.skipped = 0
        # an answer that drafts by choice (not a probe, not an exploration): opportunities come in runs
        pricing.every = 1 if gain > 0 or pricing.gain >= pricing.cost else min(2 * pricing.every, self.price_every_max)
        return ks

    def _choose(self, reqs, caps, sheet: _Sheet) -> tuple[list[int], float]:
        """-> (ks, the predicted gain of the round over plain decoding, in plain steps: 0 at k = 0)."""
        B = len(reqs)
        offers = self.offers(reqs, caps)  # per row (free drafts available, their confidences, group), or None
        # per row in one pass (auto K prices every row every round): its state, and how it drafts: as a copy where
        # offered one, else with the model, each priced by (estimate, cap, confidences, group, curve, set-up)
        states, model, copy = [], [], []
        for b, (r, o) in enumerate(zip(reqs, offers)):
            s = self._state(r)
            states.append(s)
            left = r.params.max_tokens - len(r.output_ids)
            if o is not None:
                p, g = (o[1], o[2]) if o[0] else (None, 0)
                curve = None if p is None else self.calibrations[g].curve(p, self.k_max)
                copy.append((self._alpha(s, True), min(caps[b], o[0]), p, g, curve, (0.0, left)))
            else:
                copy.append(None)
            model.append(None if o is not None and self.decline is None else
                         (self._alpha(s, False), caps[b], None, 0, None,
                          (self.costs.catch_up * self.pending(r), left)))
        if B < self.last_size:  # a row left (finished, or preempted): the batch may grow back next round
            self.rounds_at_size = 1
        elif B > self.last_size:  # a request joined: it stays for its tokens
            self.rounds_at_size = 0
        elif self.rounds_at_size:
            self.rounds_at_size += 1
        self.last_size = B
        horizon = self.rounds_at_size or 1 << 30
        # which offered rows copy: all, then (a proposer that can draft them either way) all with the model, then
        # each row flipped from the better of the two: a copy auto K would decline (a sampled row accepts a copy's
        # token with p(t) only) may still be worth the model's drawn drafts, and a row priced as a copy alone would
        # decode plainly (suffix-hybrid at 0.7: docs/benchmarks.md)
        either = [b for b in range(B) if copy[b] is not None and model[b] is not None]
        best = self._price([c is not None for c in copy], copy, model, horizon, sheet)
        if either and self.dual:
            priced = self._price([c is not None and b not in either for b, c in enumerate(copy)], copy, model,
                                 horizon, sheet)
            best = priced if priced[0] > best[0] else best
            start = best[3]
            for b in either if len(either) > 1 else ():  # one row: the two above were every choice
                free = list(start)
                free[b] = not free[b]
                priced = self._price(free, copy, model, horizon, sheet)
                best = priced if priced[0] > best[0] else best
            for b in either:
                if not best[3][b]:
                    self.decline(reqs[b])
        rate, k, m, is_free, alphas, caps, confidence, groups = best
        self.last_rate = rate
        # what drafting is predicted to gain, in plain steps (rate over plain's, MARGIN taken out of plain's rate)
        gain = rate * (sheet.verify[1] + self.overhead.get((B, False), 0.0)) / B - 1.0 if k else 0.0
        order = self._order(alphas, caps)
        ks = [0] * B
        for b in order[:m]:
            ks[b] = min(k, caps[b])
        probe_pays = None  # whether a probe could pay at all at this batch size (asked once, when a probe is due)
        for b, s in enumerate(states):
            s.confidence, s.group = confidence[b], groups[b]
            if ks[b] == 0 and caps[b] > 0:
                s.rounds_at_zero += 1
                if s.rounds_at_zero >= s.probe_every:
                    if probe_pays is None:  # a well-predicted row drafting one token alone beats plain decoding?
                        probe_pays = bool(self._best([0.9] + [0.0] * (B - 1), [1] + [0] * (B - 1), sheet=sheet)[1])
                    s.rounds_at_zero = 0  # due again in probe_every rounds, whether it probes now or not: at a
                    # batch size where no probe pays, asking every round was half of choose's pricing at 8 rows
                    if probe_pays:
                        ks[b] = 1
                        s.probe_every = min(2 * s.probe_every, PROBE_MAX)  # reset only if the row drafts by choice
            elif ks[b]:
                s.rounds_at_zero, s.probe_every = 0, PROBE_EVERY
        self._explore(ks, caps, is_free, alphas)
        self.last_choice = (max(ks), sum(1 for x in ks if x))
        return ks, gain

    def _explore(self, ks: list[int], caps: list[int], is_free: list[bool], alphas: list[float]) -> None:
        """After ``explore_every`` rounds without two model draft steps, the most promising model row drafts 2."""
        models = [b for b in range(len(ks)) if caps[b] and not is_free[b]]
        if not models:
            return
        if any(ks[b] >= 2 for b in models):  # drafting by choice: its rounds keep the prices measured
            self.unpriced, self.explore_every = 0, EXPLORE_EVERY
            return
        self.unpriced += 1
        if self.unpriced >= self.explore_every:
            b = max(models, key=lambda b: alphas[b])
            ks[b] = min(2, caps[b])
            self.unpriced, self.explore_every = 0, min(2 * self.explore_every, EXPLORE_MAX)

    def stop(self, reqs, caps: list[int], ks: list[int]) -> DraftStop | None:
        """How far a lone row drafting with its model (``ks[0]`` > 0, chosen this round) goes: up to its cap, drawing
        draft j + 1 while the chance that drafts 1 .. j are all accepted (their calibrated confidences multiplied:
        ``Calibration``) keeps it worth its price: chance x a >= R x (the verify's row j + 2 and draft step j + 1, in
        seconds, as the cost model prices them), with R the round's predicted rate (tokens a second, ``choose``'s) and
        a the row's acceptance estimate (draft j + 1's own confidence is not known before it is drawn). None where
        there is nothing to decide: a batch, K = 0, no prices this round, or ``stops`` off.

        Why: K is chosen before drafting from one rate a row, but the head knows, draft by draft, how sure it is, and
        that predicts acceptance well (SmolLM2's EAGLE-3 head: drafts of confidence >= 0.9 accepted at 0.99, < 0.3 at
        ~0.25). Replayed on rounds of 8 drafts (24 held-out prompts, greedy, half calibrating the other), drafting by
        confidence read 1.56-1.71x plain decoding against 1.48-1.60x for the best fixed K; in place, against auto K's
        K (Zen 4, 16 prompts, two runs each): 1.022-1.048x at temperature 0.7 (its unsure rounds end after 1-2
        drafts), 1.007-1.011x greedy (docs/benchmarks.md, "rounds as long as the head's confidence carries them")."""
        if not self.stops or len(reqs) != 1 or not ks[0] or self.sheet is None or self.costs is None:
            return None
        cap = min(caps[0], self.k_max)
        if cap < 1:
            return None
        verify = self.sheet.verify  # T = 0 .. k_max + 1
        if 1 not in self.sheet.drafts:
            self.sheet.drafts[1] = self.costs.draft_costs(1, self.k_max)
        drafts = self.sheet.drafts[1]
        per_token = self.last_rate / max(self.alpha(reqs[0]), 0.05)
        # draft j + 1's price: the verify's row j + 2 and its draft step (drafts[j + 1] - drafts[j]), j = 1 .. cap - 1
        below = [per_token * max(verify[j + 2] - verify[j + 1] + drafts[j + 1] - drafts[j], 0.0)
                 for j in range(1, cap)]
        cal = self.draft_calibrations[not reqs[0].params.greedy]
        table = torch.tensor([a / j for a, j in zip(cal.accepted, cal.judged)])
        return DraftStop(cap, table, torch.tensor(below or [0.0]))

    def cut(self, reqs, nd: list[int], confidence: list[list[float]], free: list[bool] | None,
            sampled: list[bool]) -> list[int]:
        """How many of each row's drafts to verify, now that they are drafted: a prefix of each model row's, by the
        drafter's confidence in each draft (``Proposal.confidence``; NaN: none, a copy's, kept whole).

        A draft is worth the chance that it is reached and accepted, prod_{i<=j} c(p_i) (c: acceptance by the
        drafter's probability, ``Calibration``, learnt from the drafts judged), and costs its share of the verify
        (the cost model's price of the forward's width). The drafting is spent either way, so the round keeps the
        drafts that maximise tokens - R x seconds, R the round's rate (tokens per second of the whole round, drafts
        included; computed with every draft, then again with the cut: a renewal-reward rate, at which each kept draft
        still pays for its verify). The drafts, taken by that chance (each row's in order: the chance only falls along
        a row), are kept up to the best count.

        Greedy rows only (``sampled[b]`` False): their output is the target's argmax chain whatever drafts are
        verified. A drawn draft kept or cut by its own probability q(t_j) would be lossy: the drafts verified would
        follow q restricted to the confident ones, not the q they are judged by (the engine's chi-square test
        catches that variant, ``cut_drawn``: tests/test_engine_distribution.py). A lossless cut of a drawn row could
        use the confidences before draft j only; at temperature 0.7 even the lossy one measured no gain, so drawn
        rows verify every draft."""
        B = len(reqs)
        if not self.cuts or self.costs is None:
            return nd
        rows = [b for b in range(B) if nd[b] > 0 and (self.cut_drawn or not sampled[b]) and
                not (free and free[b]) and all(p == p for p in confidence[b][:nd[b]])]  # NaN: no confidence
        for b, r in enumerate(reqs):
            s = self.state.get(r)
            if s is not None:
                s.drafted = None
        if not rows:
            return nd
        cand = []  # (-chance, position, row): the chance that the draft is reached and accepted
        for b in rows:
            cal, alive = self.draft_calibrations[sampled[b]], 1.0
            for j, p in enumerate(confidence[b][:nd[b]]):
                alive *= cal(p)
                cand.append((-alive, j, b))
        cand.sort()  # a row's own in order: its chance never rises along it (ties: by position)
        cuttable = set(rows)
        fixed = sum(nd[b] for b in range(B) if b not in cuttable)  # drafts verified whatever (copies)
        others = sum(expected_tokens(self.alpha(reqs[b], bool(free and free[b])), nd[b]) - 1.0 for b in range(B)
                     if b not in cuttable and nd[b])  # the rows verified whole, at their estimates
        # the prices choose read this round (nothing refreshes the cost model between the two), else read now
        sheet, self.sheet = self.sheet, None
        k_top = max(nd[b] for b in rows)
        if sheet is not None and sheet.B == B and max(nd) <= self.k_max:
            verify = sheet.verify
            if len(rows) not in sheet.drafts:
                sheet.drafts[len(rows)] = self.costs.draft_costs(len(rows), self.k_max)
            spent = sheet.drafts[len(rows)][k_top]
        else:
            verify, spent = self.costs.verify_costs(B, max(nd) + 1), self.costs.draft_cost(len(rows), k_top)
        spent += self.overhead.get((B, True), 0.0)

        def price(drafts: int) -> float:  # the verify of B rows with `drafts` drafts among them (pads skipped)
            t = 1.0 + drafts / B
            lo = int(t)
            return verify[lo] if lo == t else verify[lo] + (t - lo) * (verify[lo + 1] - verify[lo])

        keep = len(cand)
        for _ in range(2):  # R with every draft, then with the cut
            gained = B + others + sum(-c for c, _, _ in cand[:keep])
            rate = gained / (price(fixed + keep) + spent)
            best, keep, acc = -rate * price(fixed), 0, 0.0
            for n, (c, _, _) in enumerate(cand, 1):
                acc -= c
                value = acc - rate * price(fixed + n)
                if value > best:
                    best, keep = value, n
        out = list(nd)
        for b in rows:
            out[b] = 0
        for _, j, b in cand[:keep]:
            out[b] = max(out[b], j + 1)
        for b in rows:  # every draft drafted: observe calibrates by those judged and counts the cut ones' chances
            s = self._state(reqs[b])
            s.drafted = confidence[b][:nd[b]]
        return out

    def observe(self, req, k, n, logits=None, free=False):
        s = self._state(req)
        drafted, s.drafted = s.drafted, None  # this round's alone
        judged = min(n + 1, k)
        # drafts 0..judged-1 were judged: all accepted but a rejected last
        if free and s.confidence is not None:
            cal = self.calibrations[s.group]
            for j, p in enumerate(s.confidence[:judged]):
                cal.observe(p, j < n)
        accepted, counted = float(n), float(judged)
        if drafted is not None and not free:
            cal = self.draft_calibrations[s.drawn]
            for j, p in enumerate(drafted[:judged]):
                cal.observe(p, j < n)
            if n == k:  # every draft verified was accepted: the ones cut would have been judged next, each while
                alive = 1.0  # those before it were accepted (expected counts). The row's estimate prices drafts
                for p in drafted[k:]:  # as drafted (``choose``), not only the confident ones the cut keeps
                    counted += alive
                    alive *= cal(p)
                    accepted += alive
        if not counted:
            return None
        if free:
            s.free_accepted, s.free_judged = DECAY * s.free_accepted + n, DECAY * s.free_judged + judged
            self.global_free_accepted = 0.99 * self.global_free_accepted + n
            self.global_free_judged = 0.99 * self.global_free_judged + judged
        else:
            d = DRAWN_DECAY if s.drawn else DECAY
            s.accepted, s.judged = d * s.accepted + accepted, d * s.judged + counted
            self.global_accepted = 0.99 * self.global_accepted + accepted
            self.global_judged = 0.99 * self.global_judged + counted
        return None

    # Without a cost model yet (the decoder is not ready: it decodes plainly meanwhile), nothing is refreshed.
    def timed(self, B: int, T: float, verify_s: float) -> None:
        """A target forward over B rows x T tokens took ``verify_s`` (T: its real tokens over B, fractional where rows
        drafted unequal K: the pads are skipped)."""
        self.sheet = None  # the forward is done: the cost model moves on
        if self.costs is not None:
            self.costs.refresh_verify(B, T, verify_s)

    def drafted(self, rows: int, steps: int, first_s: float, steps_s: float) -> None:
        """A round's ``steps`` model draft steps over ``rows`` rows: the first took ``first_s``, the rest ``steps_s``
        (a round priced whole: CostModel.draft_cost)."""
        if self.costs is not None and steps:
            self.costs.refresh_draft(rows, steps, first_s + steps_s)

    def caught_up(self, tokens: int, seconds: float) -> None:
        """The proposer fed ``tokens`` of lazy prefill in ``seconds``."""
        if self.costs is not None:
            self.costs.refresh_catch_up(tokens, seconds)

    def round_overhead(self, B: int, spec: bool, seconds: float) -> None:
        """A step's wall time minus its timed forwards: an EMA per (B, speculative?), clamped like the costs."""
        if self.costs is None:
            return
        old = self.overhead.get((B, spec))
        seconds = max(0.0, seconds)
        self.overhead[(B, spec)] = seconds if old is None else \
            old + self.costs.ema * (min(seconds, CostModel.OUTLIER * old + 1e-4) - old)
