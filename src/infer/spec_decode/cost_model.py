"""What a speculative round costs on this machine: target forwards of B rows x T tokens, draft steps of B rows, and
the drafter's lazy catch-up, measured at start-up and refreshed by every round (spec_decode.spec_length reads it).

    costs = profile_costs(run_verify, run_draft, profile_batch, k_max, max_batch)   # start-up (spec_decode.setup)
    costs.verify_cost(B, T), costs.draft_cost(B, k), costs.catch_up                  # seconds
    costs.refresh_verify(B, T, s), costs.refresh_draft(B, k, s), costs.refresh_catch_up(n, s)  # rounds
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CostModel:
    """Seconds per target forward over B rows x T tokens (``verify_cost(B, T)``, T = 1 is a plain decode step) and
    per k draft steps over B rows (``draft_cost(B, k)``), for B = 1..max_batch and T = 1..k_max + 1.

    The shape over (B, T) comes from a start-up profile at a few points, interpolated in between (``verify``). Every
    target forward the engine runs then refits, per batch size, a line from profiled to measured seconds: measured ~
    a_B + b_B x profiled, least squares over the forwards of B (their statistics decayed by FIT_DECAY a forward), with
    a pseudo-forward at the origin (weight RIDGE) that pulls the offset toward 0. While a batch size runs one width
    only, the line is therefore one factor (measured / profiled), the refresh this replaced; forwards of several
    widths fit the offset and the slope apart. Why: the profile runs at a short context (32 tokens) and on a quieter
    moment; at real contexts the gap was a factor for the demo pair (every width 1.3-1.6x its profile), but for SmolLM2
    on AVX2 mostly an offset plus a flatter slope than profiled (a 9-token verify 2.5 decode steps where the profile
    said 2.9), and one factor priced wide verifies too high, so auto K drafted shorter than paid (docs/benchmarks.md,
    suffix decoding). One line per batch size, not a price per cell: a per-cell EMA left the widths a batch rarely
    runs (and its plain step, once it speculates) at their profiled values. A batch size not measured yet takes the
    latest fitted level as a factor (``last_scale``).

    A round's drafts are priced by how many there are (``rounds``: k -> a round's k draft steps in all, measured per
    k), not as k times one step. The first step also pays the round's set-up and feeds what the drafter has not seen
    since the last round (an EAGLE head: the accepted run, up to K + 1 entries), and an EAGLE head runs its round as
    one compiled call of up to 4 steps (EagleHead.draft_round; SmolLM2's EAGLE-3 head on the AMD EPYC Zen 4 host:
    rounds of 2, 3, 4 drafts 1.0, 1.3, 1.5 ms), so a round's price is mostly its fixed part. One price a step made
    rounds of k = 1-2 price a step at 2-3x its cost, and auto K stopped drafting on a drafter that pays at k = 4
    (docs/benchmarks.md, drafters); a first step priced apart from an average later step still priced a round's 3
    later steps at up to twice their cost when rounds of 2 drafts were the common ones, and so kept them the common
    ones. A k no round has drafted yet is read off the least-squares line through the k measured (with one, the
    profile's curve scaled to it; with none, the profile: a first step and k - 1 later ones)."""

    max_batch: int
    k_max: int
    verify: list[list[float]] = field(default_factory=list)  # [max_batch + 1][k_max + 2] profiled; index 0 unused
    draft: list[float] = field(default_factory=list)  # [max_batch + 1] profiled: a draft step after a round's first
    draft_first: list[float] = field(default_factory=list)  # [max_batch + 1] profiled: a round's first draft step
    rounds: list[dict[int, float]] = field(default_factory=list)  # [max_batch + 1] k -> a round's k drafts, EMA
    ema: float = 0.2
    # B -> decayed sums over its measured forwards [w, sum x, sum y, sum x^2, sum x y], x profiled and y measured s
    fit: dict[int, list[float]] = field(default_factory=dict)
    last_scale: float = 1.0  # the latest fitted level (mean y / mean x) of any B: the guess for a B not yet measured
    catch_up: float = 0.0  # seconds per token of the drafter's lazy prefill (a row fed alone), EMA

    def __post_init__(self):
        if not self.draft_first:  # profiled: a lone draft step of one token a row, the same for both until rounds run
            self.draft_first = list(self.draft)
        if len(self.draft_first) != len(self.draft):
            raise ValueError(f"draft_first has {len(self.draft_first)} entries, draft {len(self.draft)}")
        if not self.rounds:
            self.rounds = [{} for _ in self.draft]

    @classmethod
    def from_points(cls, max_batch: int, k_max: int, verify_pts: dict, draft_pts: dict) -> CostModel:
        """verify_pts {(B, T): s} and draft_pts {B: s} at a few points -> dense tables (piecewise linear)."""
        def interp(xs, ys, x):
            if len(xs) == 1:
                return ys[0]
            if x <= xs[0]:
                return ys[0] * x / xs[0] if xs[0] > 1 else ys[0]
            for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
                if x <= x1:
                    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            x0, y0, x1, y1 = xs[-2], ys[-2], xs[-1], ys[-1]  # extrapolate the last segment
            return y1 + (y1 - y0) * (x - x1) / max(1, x1 - x0)

        bs = sorted({b for b, _ in verify_pts})
        ts = sorted({t for _, t in verify_pts})
        by_b = {b: [interp(ts, [verify_pts[b, t] for t in ts], t) for t in range(k_max + 2)] for b in bs}
        verify = [[0.0] * (k_max + 2)] + [
            [interp(bs, [by_b[b][t] for b in bs], B) if len(bs) > 1 else by_b[bs[0]][t] for t in range(k_max + 2)]
            for B in range(1, max_batch + 1)]
        dbs = sorted(draft_pts)
        draft = [0.0] + [interp(dbs, [draft_pts[b] for b in dbs], B) if dbs else 0.0 for B in range(1, max_batch + 1)]
        return cls(max_batch, k_max, verify, draft)

    def _cell(self, B: int, T: float) -> float:
        """The profiled forward of B rows x T tokens. A fractional T is a ragged forward of B x T real tokens (rows
        drafting unequal K: the kernels skip the pads, kernels/rows.h), between the cells around it."""
        row = self.verify[min(B, self.max_batch)]
        T = min(T, self.k_max + 1)
        lo = int(T)
        return row[lo] if lo == T else row[lo] + (T - lo) * (row[lo + 1] - row[lo])

    FIT_DECAY = 0.9  # per forward of a batch size: its line follows the last ~10 of them
    RIDGE = 0.1  # the weight, in forwards, of the pseudo-forward at the origin (0 s profiled takes 0 s)
    SLOPE = (0.25, 4.0)  # bounds of a fitted slope: a price still grows with T, and a few noisy forwards stay sane

    def line(self, B: int) -> tuple[float, float] | None:
        """(a, b): B's measured seconds ~ a + b x profiled seconds, fitted over its forwards; None before any."""
        s = self.fit.get(min(B, self.max_batch))
        if not s or s[0] <= 0:
            return None
        w, sx, sy, sxx, sxy = s
        w += self.RIDGE  # the pseudo-forward at (0, 0) adds weight and nothing to the sums
        det = w * sxx - sx * sx  # >= RIDGE * sxx > 0: one width measured still gives a unique line, the factor
        b = min(max((w * sxy - sx * sy) / det, self.SLOPE[0]), self.SLOPE[1])
        return (sy - b * sx) / w, b

    def _price(self, x: float, ab: tuple[float, float] | None) -> float:
        """Seconds of a forward profiled at ``x`` seconds, on its batch size's fitted line ``ab`` (None: none yet)."""
        if ab is None:
            return x * self.last_scale
        return max(ab[0] + ab[1] * x, 0.25 * x)  # the floor: an offset fitted below zero never prices a forward ~free

    def verify_cost(self, B: int, T: float) -> float:
        return self._price(self._cell(B, T), self.line(B))

    def verify_costs(self, B: int, t_max: int) -> list[float]:
        """[verify_cost(B, T) for T = 0..t_max] (T = 0: 0.0), B's fitted line read once (a round prices every K)."""
        ab = self.line(B)
        row = self.verify[min(B, self.max_batch)]  # integer widths: the profiled cells themselves (_cell, inline)
        return [0.0] + [self._price(row[min(T, self.k_max + 1)], ab) for T in range(1, t_max + 1)]

    def draft_cost(self, B: int, k: int = 1) -> float:
        """Seconds of a round's k draft steps over B rows: as measured for k (``rounds``), else off the least-squares
        line through the k measured (its slope at least a tenth of their mean step, so a price still grows with k),
        else the profile scaled to the one measured, else the profile; at most what a longer round measured (more
        drafts never cost less: a k whose price a stall raised, and which auto K therefore stopped drafting, is not
        held there by its own stale EMA)."""
        return self.draft_costs(B, k)[k] if k > 0 else 0.0

    def draft_costs(self, B: int, k_max: int) -> list[float]:
        """[draft_cost(B, k) for k = 0..k_max], the measured rounds' line fitted once (auto K prices every k of a round,
        as ``verify_costs`` reads a batch size's line once)."""
        if not B:
            return [0.0] * (k_max + 1)
        b = min(B, self.max_batch)
        cells = self.rounds[b]
        first, step = self.draft_first[b], self.draft[b]
        profiled = lambda k: first + (k - 1) * step  # noqa: E731
        if len(cells) > 1:  # the line through the k measured
            n = len(cells)
            mx, my = sum(cells) / n, sum(cells.values()) / n
            slope = sum((x - mx) * (y - my) for x, y in cells.items()) / sum((x - mx) ** 2 for x in cells)
            floor = 0.1 * my / mx  # a tenth of the mean step
            slope = max(slope, floor)
        elif cells:
            (k0, s0), = cells.items()
        # longer[k]: the cheapest measured round of more than k drafts (a price never rises above it)
        longer = [float("inf")] * (k_max + 1)
        for j, s in cells.items():
            for k in range(1, min(j, k_max + 1)):
                longer[k] = min(longer[k], s)
        out = [0.0]
        for k in range(1, k_max + 1):
            if k in cells:
                out.append(min(cells[k], longer[k]))
            elif not cells:
                out.append(profiled(k))
            elif len(cells) == 1:
                out.append(min(s0 * profiled(k) / profiled(k0) if profiled(k0) > 0 else s0 * k / k0, longer[k]))
            else:
                out.append(min(max(my + slope * (k - mx), floor * k), longer[k]))
        return out

    # A shared machine only ever slows a step down, sometimes by a lot (another process, a page fault): one sample
    # moves an estimate by at most OUTLIER x its value, so a stall does not switch speculation off on its own. For the
    # same reason a sample under 1 / OUTLIER of the price replaces it: the price was a stall's (a profile taken while
    # another engine compiled priced the demo pair's draft step at 365 ms against 0.8; an EMA from there took ~30
    # exploration rounds, which come ever more rarely, and the engine never drafted again).
    OUTLIER = 2.0

    def _update(self, old: float, seconds: float) -> float:
        if old <= 0 or seconds * self.OUTLIER < old:
            return seconds
        return old + self.ema * (min(seconds, self.OUTLIER * old) - old)

    def refresh_verify(self, B: int, T: float, seconds: float) -> None:
        """One target forward over B x T tokens took ``seconds`` (T fractional: its rows' real tokens over B, the pads
        skipped): add it to B's line (at most OUTLIER x its price)."""
        x = self._cell(B, T) if 1 <= B <= self.max_batch and 1 <= T <= self.k_max + 1 else 0.0
        if x <= 0:
            return
        y = min(seconds, self.OUTLIER * self.verify_cost(B, T))
        s = [self.FIT_DECAY * v for v in self.fit.get(B, [0.0] * 5)]
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] += v
        self.fit[B] = s
        self.last_scale = s[2] / s[1]

    def refresh_draft(self, B: int, k: int, seconds: float) -> None:
        """A round drafted k tokens over B rows with its model in ``seconds`` (its set-up and every step)."""
        if 1 <= B <= self.max_batch and k >= 1:
            self.rounds[B][k] = self._update(self.rounds[B].get(k, 0.0), seconds)

    def refresh_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.catch_up = self._update(self.catch_up, seconds / tokens)


# A stored profile is measured anew where one row's verify widths, timed at start, differ in proportion from its prices
# by more than this factor (same_shape)
SHAPE_TOLERANCE = 2.0


def same_shape(costs: CostModel, measured: dict[int, float], B: int = 1) -> bool:
    """Whether ``measured`` ({T: seconds of a forward of B rows x T tokens}) is in proportion to what ``costs`` prices
    those widths: every width's measured / priced within SHAPE_TOLERANCE of every other's. A level apart (a busier
    hour) is what the rounds' fitted line absorbs; a shape apart was profiled under other conditions (SmolLM2's
    profile taken under a sampling profiler priced 4 and 9 tokens at 6x a decode step, and auto K never drafted past
    one token again in later processes)."""
    r = [s / p for T, s in measured.items() if (p := costs.verify_cost(B, T)) > 0]
    return not r or max(r) <= SHAPE_TOLERANCE * min(r)


def profile_widths(k_max: int) -> list[int]:
    """Tokens per row of the steps that start-up runs (profiling, warming compiled graphs): decode, the narrowest and
    the widest verify, and one between (the cost model interpolates the rest)."""
    return sorted({1, 2, min(4, k_max + 1), k_max + 1})


def profile_costs(run_verify, run_draft, profile_batch: int, k_max: int, max_batch: int,
                  repeats: int = 3) -> CostModel:
    """Measure the cost model's anchor points: ``run_verify(B, T)`` and ``run_draft(B)`` each run one forward of B
    <= ``profile_batch`` rows and return its seconds; the best of ``repeats`` counts (a shared machine only ever
    slows a run down). Batches up to ``max_batch`` are interpolated or extrapolated from them."""
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= profile_batch} | {profile_batch})
    tokens = profile_widths(k_max)
    verify = {(b, t): min(run_verify(b, t) for _ in range(repeats)) for b in batches for t in tokens}
    # more tokens never cost less: a point above a wider one's (or a larger batch's) was slowed by something else
    # (a profile of the demo pair read a 1-token forward at 7.5 ms and a 2-token one at 3.6)
    for j in range(len(batches) - 1, -1, -1):
        for i in range(len(tokens) - 1, -1, -1):
            b, t = batches[j], tokens[i]
            wider = [verify[b, tokens[i + 1]]] if i + 1 < len(tokens) else []
            larger = [verify[batches[j + 1], t]] if j + 1 < len(batches) else []
            verify[b, t] = min([verify[b, t], *wider, *larger])
    draft = {b: min(run_draft(b) for _ in range(repeats)) for b in batches} if run_draft is not None else {}
    return CostModel.from_points(max_batch, k_max, verify, draft)

