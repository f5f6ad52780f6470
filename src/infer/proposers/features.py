"""FeatureStore: the target's hidden states, per request, for the proposers that draft from them (EAGLE, Medusa).

The runner hands over the hidden state of every position the target computes (``ModelRunner.feature_sink``):
each prefill chunk's, each plain decode step's, and after a verify pass those of the last token and the accepted
drafts only (positions past the accepted run describe rejected drafts and are never handed over). So the store
holds, per request, f_i for a contiguous run of positions [start, end) of its sequence, f_i being the final-norm
state at position i (its logits gave token i+1).

Invariants: what is stored describes the sequence's tokens only, never unaccepted drafts; a hand-over that starts
before ``end`` (a preempted request prefilled again) replaces what followed; a gap (a prefix-cache hit, whose
positions the target never computed) reads back as zeros: a proposer then drafts worse, never wrongly, since
verification decides every token.
"""

from __future__ import annotations

import weakref

import torch

from ..request import Request


class FeatureStore:
    def __init__(self):
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> (start, [n, H])

    def add(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """``hidden`` [n, H]: f_start .. f_{start+n-1}."""
        hidden = hidden.detach().clone()  # a compiled step may reuse its output buffer
        cur = self._of.get(req)
        if cur is None or start < cur[0]:
            self._of[req] = (start, hidden)
            return
        s0, buf = cur
        end = s0 + len(buf)
        if start < end:  # recomputed positions: drop what followed them
            buf = buf[:start - s0]
        elif start > end:  # never computed (prefix cache): zeros
            buf = torch.cat([buf, buf.new_zeros(start - end, buf.shape[1])])
        self._of[req] = (s0, torch.cat([buf, hidden]))

    def end(self, req: Request) -> int:
        """One past the last stored position (0: none)."""
        cur = self._of.get(req)
        return 0 if cur is None else cur[0] + len(cur[1])

    def get(self, req: Request, start: int, end: int, hidden_size: int, dtype, device) -> torch.Tensor:
        """f_start .. f_{end-1} as [end - start, H] (zeros where nothing is stored)."""
        out = torch.zeros(end - start, hidden_size, dtype=dtype, device=device)
        cur = self._of.get(req)
        if cur is not None:
            s0, buf = cur
            lo, hi = max(start, s0), min(end, s0 + len(buf))
            if lo < hi:
                out[lo - start:hi - start] = buf[lo - s0:hi - s0]
        return out

    def last(self, req: Request) -> tuple[int, torch.Tensor] | None:
        """(position, f) of the last stored position, or None."""
        cur = self._of.get(req)
        if cur is None or not len(cur[1]):
            return None
        return cur[0] + len(cur[1]) - 1, cur[1][-1]

    def drop_before(self, req: Request, pos: int) -> None:
        """Forget positions < pos (consumed): the store stays a few rows a request."""
        cur = self._of.get(req)
        if cur is not None and pos > cur[0]:
            s0, buf = cur
            self._of[req] = (min(pos, s0 + len(buf)), buf[pos - s0:])
