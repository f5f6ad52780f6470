"""Structured output inside a speculative round: one mask per judged position, the drafter drawing under them.

For a constrained request (``Request.grammar``, infer.structured) a round needs the allowed tokens at each of the
K+1 positions the target judges: position j after the request's output and drafts 1 .. j. The matcher walks the
drafts once, filling mask row j before it consumes draft j, and is rolled back to the request's output at the end
(``release``). A model drafter draws under the same masks (``restrict`` before a draw, ``push`` after it), so its
q has no mass on a disallowed token and no verify is spent on a draft the grammar forbids; deterministic drafts
(n-gram, trees) are checked after proposing (``finish``).

Exactness (relative to the masked target p'):
- drafts drawn from the masked q are allowed; rejection sampling with p' and that q is the usual exact rule;
- a deterministic draft the grammar forbids would be rejected with probability 1 (p'(t) = 0) and the residual is p'
  itself (p' without t), so cutting the row's drafts there and drawing its bonus from p' is the same law; the
  same holds where no draft-vocabulary token is allowed (q puts no mass on p''s support): the row stops drafting;
- rows and positions past a row's last judged position keep an all-ones mask; their tokens are never emitted.
"""

from __future__ import annotations

import dataclasses

import torch

from ..proposers.base import Proposal
from ..request import Request
from ..structured import bit, mask_bias
from .tree import DraftTree


class _Row:
    __slots__ = ("matcher", "masks", "filled", "pushed", "limit")

    def __init__(self, matcher, K: int):
        self.matcher = matcher
        self.masks = matcher.compiler.bitmask(K + 1)  # [K+1, words]: all allowed until filled
        self.filled = 0  # mask rows computed (row j after drafts 1 .. j)
        self.pushed = 0  # drafts the matcher consumed this round
        self.limit = K  # no draft at or past this position (a forbidden draft, EOS, or nothing allowed)


class RoundGrammar:
    """The masks of one round's constrained rows, keyed by request (a proposer may draft for a subset of rows)."""

    def __init__(self, reqs: list[Request], K: int, vocab_size: int):
        self.K, self.V = K, vocab_size
        self.rows = {r: _Row(r.grammar, K) for r in reqs if r.grammar is not None}

    @classmethod
    def of(cls, reqs: list[Request], K: int, vocab_size: int) -> RoundGrammar | None:
        return cls(reqs, K, vocab_size) if any(r.grammar is not None for r in reqs) else None

    def _fill(self, row: _Row, j: int) -> bool:
        """Mask row ``j`` (the matcher stands after drafts 1 .. j); False where no draft may stand at ``j``."""
        if j >= row.limit or row.pushed != j:
            return False
        if row.filled == j:
            row.matcher.fill(row.masks, j)
            row.filled = j + 1
        return True

    def _push(self, r: Request, row: _Row, j: int, token: int) -> bool:
        """Consume draft ``j`` if its mask allows it; else no drafts from ``j`` on."""
        if not self._fill(row, j):  # mask row j first (a no-op where the draw was restricted by it)
            return False
        if not bit(row.masks[j], token) or not row.matcher.accept(token):
            row.limit = j
            return False
        row.pushed = j + 1
        if token in r.eos:  # nothing after an end of sequence is ever emitted
            row.limit = j + 1
        return True

    # -- a model drafter's draws --------------------------------------------------------------------------------
    def restrict(self, j: int, reqs: list[Request], logits: torch.Tensor, ids: torch.Tensor | None = None):
        """Draft position ``j`` of ``reqs``: their logits [n, V] (or [n, N] over the draft vocabulary ``ids``) with
        what the grammar forbids at -inf. A row with no allowed column is left as it is and drafts no further."""
        picked = [(i, self.rows[r]) for i, r in enumerate(reqs) if r in self.rows]
        picked = [(i, row) for i, row in picked if self._fill(row, j)]
        if not picked:
            return logits
        bias = mask_bias(torch.stack([row.masks[j] for _, row in picked]), self.V)  # [n, V]: 0 or -inf
        if ids is not None:
            bias = bias[:, ids.cpu()]  # [n, N]
        empty = torch.isinf(bias).all(-1)
        for (i, row), e in zip(picked, empty.tolist()):
            if e:
                row.limit = j
        bias[empty] = 0.0
        logits = logits.clone()
        rows = torch.tensor([i for i, _ in picked], device=logits.device)
        logits[rows] += bias.to(logits.device)
        return logits

    def push(self, j: int, reqs: list[Request], drafts: torch.Tensor) -> None:
        """The drafts [n] just drawn at position ``j`` for ``reqs``: advance their matchers."""
        toks = drafts.tolist()
        for r, t in zip(reqs, toks):
            row = self.rows.get(r)
            if row is not None:
                self._push(r, row, j, t)

    # -- the round ------------------------------------------------------------------------------------------------
    def finish(self, reqs: list[Request], drafts: list[list[int]], num_draft: list[int]) -> list[int]:
        """Walk the rest of each constrained row's drafts (host lists) through its matcher; -> the drafts each row
        keeps (cut at the first one the grammar forbids), with mask rows filled up to the bonus position."""
        out = list(num_draft)
        for b, r in enumerate(reqs):
            row = self.rows.get(r)
            if row is None:
                continue
            j = row.pushed
            while j < out[b] and self._fill(row, j) and self._push(r, row, j, drafts[b][j]):
                j += 1
            out[b] = min(out[b], j, row.limit)
            if row.pushed == out[b] and row.filled == out[b] and (out[b] == 0 or drafts[b][out[b] - 1] not in r.eos):
                row.matcher.fill(row.masks, out[b])  # the bonus position's mask
                row.filled = out[b] + 1
        return out

    def apply(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """The target's logits [B, T, V] of a verify (T <= K+1), in place: each constrained row's positions masked."""
        B, T, V = logits.shape
        idx = [b for b, r in enumerate(reqs) if r in self.rows]
        if idx:
            bias = mask_bias(torch.stack([self.rows[reqs[b]].masks[:T] for b in idx]), V)  # [n, T, V]
            rows = torch.tensor(idx, device=logits.device)
            logits[rows] += bias.to(logits.device)
        return logits

    def release(self) -> None:
        """Every matcher back to its request's output (the drafts it consumed given back)."""
        for row in self.rows.values():
            row.matcher.rollback(row.pushed)
            row.pushed = 0


def prune_tree(req: Request, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
    """A constrained row's draft tree without the branches its grammar forbids, and the mask at every node kept
    ([N', words]: row i, what may follow node i's path). Tree candidates are deterministic, so a forbidden node
    would be rejected with certainty and dropping it changes nothing in the law (module docstring). Nodes come back
    in depth-first order (a parent before its children), the matcher as it was."""
    m = req.grammar
    kids: list[list[int]] = [[] for _ in tree.tokens]
    for i, p in enumerate(tree.parents[1:], 1):
        kids[p].append(i)
    out, masks = DraftTree(tree.root), m.compiler.bitmask(len(tree))

    def visit(i: int, node: int) -> None:  # the matcher stands after the path to ``node``
        if i and tree.tokens[i] in req.eos:
            return  # nothing after an end of sequence is emitted: its row stays all-allowed
        m.fill(masks, node)
        for c in kids[i]:
            t = tree.tokens[c]
            if bit(masks[node], t) and m.accept(t):
                visit(c, out.add(node, t, tree.scores[c]))
                m.rollback(1)

    visit(0, 0)
    return out, masks[:len(out)]


def forced_drafts(reqs: list[Request], caps: list[int]) -> dict[int, list[int]]:
    """Rows whose grammar forces their next tokens (a JSON key, its ``":``, a closing brace's EOS): those tokens, up to
    the row's cap. They are drafted for free, as deterministic drafts verified like any other (exact), and the
    proposer skips the row this round (a drafter's cache never holds a token it did not draft itself)."""
    out = {}
    for b, (r, cap) in enumerate(zip(reqs, caps)):
        if r.grammar is not None and cap > 0:
            tokens = r.grammar.forced()[:cap]
            if tokens:
                out[b] = tokens
    return out


def with_forced(prop: Proposal, forced: dict[int, list[int]], K: int, vocab_size: int) -> Proposal:
    """``prop`` widened to K drafts a row, the ``forced`` rows' drafts set to their forced tokens (q one-hot there,
    where the proposal has a q; those rows count as free drafts)."""
    B = prop.drafts.shape[0]

    def widen(x, fill_shape):
        if x is None:
            return None
        out = torch.zeros(B, K, *fill_shape, dtype=x.dtype, device=x.device)
        out[:, :x.shape[1]] = x
        return out

    drafts, q, logits = widen(prop.drafts, ()), widen(prop.q, (vocab_size,)), widen(prop.logits, (vocab_size,))
    confidence = widen(prop.confidence, ())
    nd, free = list(prop.num_draft), list(prop.free or [False] * B)
    for b, tokens in forced.items():
        t = torch.tensor(tokens, device=drafts.device)
        drafts[b] = 0
        drafts[b, :len(t)] = t
        nd[b], free[b] = len(t), True
        if confidence is not None:
            confidence[b] = float("nan")
        if q is not None:
            q[b] = 0.0
            q[b, torch.arange(len(t)), t] = 1.0
    return dataclasses.replace(prop, drafts=drafts, num_draft=nd, q=q, logits=logits, confidence=confidence, free=free)
