"""FeatureStore: the target's hidden states, per request, for the proposers that draft from them (EAGLE, Medusa).

The runner hands over the hidden state of every position the target computes (``ModelRunner.feature_sink``):
each prefill chunk's, each plain decode step's, and after a verify pass those of the last token and the accepted
drafts only (positions past the accepted run describe rejected drafts and are never handed over). So the store
holds, per request, f_i for a contiguous run of positions [start, end) of its sequence, f_i being the final-norm
state at position i (its logits gave token i+1).

Invariants: what is stored describes the sequence's tokens only, never unaccepted drafts; a hand-over that starts
before ``end`` (a preempted request prefilled again) replaces what followed; a gap (a prefix-cache hit, whose
positions the target never computed) reads back as zeros: a proposer then drafts worse, never wrongly, since
verification decides every token. A hand-over is kept as given, a view of the forward's output, not a copy: the
runner's forwards return fresh tensors and nothing writes into them afterwards (a forward whose output buffer were
reused by the next call, as a CUDA graph's is, would need ``add`` to copy again; infer runs none).
"""

from __future__ import annotations

import weakref

import torch

from ..request import Request


class FeatureStore:
    """Per request: (start, chunks, rows), the positions [start, start + rows) as the chunks handed over, in order.

    A plain decode step hands over one row; joining it to what the request holds each step (the store's old way)
    copied the whole run again every step, and a run grows through the plain steps between two drafting rounds (auto
    K answers k = 0 in most steps of a lone SmolLM2 request): ~0.09 ms a step. Chunks are joined once, when a round
    reads them (``get``), and the columns a reader wants are cut there too (``cols``): a hand-over is one list append,
    not the two tensor operations of a column slice and a copy (~50 of a plain step's ~100 us of hand-over, cold, on
    the AMD EPYC Zen 4 host)."""

    def __init__(self, cols: slice = slice(None)):
        """``cols``: the columns of a handed-over state that ``get`` and ``last`` read (an EAGLE-3 head's: the
        captured layers after the final state)."""
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> [start, [chunks], rows]
        self.cols = cols

    def add(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """``hidden`` [n, W]: f_start .. f_{start+n-1} (kept, not copied: the module docstring)."""
        cur = self._of.get(req)
        if cur is None or start < cur[0]:
            self._of[req] = [start, [hidden] if len(hidden) else [], len(hidden)]
            return
        end = cur[0] + cur[2]
        if start < end:  # recomputed positions: drop what followed them
            self._keep(cur, start - cur[0])
        elif start > end:  # never computed (prefix cache): zeros
            cur[1].append(hidden.new_zeros(start - end, hidden.shape[1]))
            cur[2] += start - end
        if len(hidden):  # no empty chunk: ``last`` reads the last chunk's last row
            cur[1].append(hidden)
            cur[2] += len(hidden)

    @staticmethod
    def _joined(cur: list) -> torch.Tensor:
        """The request's rows as one tensor [rows, H] (its chunks joined, and kept so; rows > 0)."""
        if len(cur[1]) > 1:
            cur[1] = [torch.cat(cur[1])]
        return cur[1][0]

    def _keep(self, cur: list, n: int) -> None:
        """Keep the first n rows."""
        cur[1], cur[2] = ([self._joined(cur)[:n]] if n else []), n

    def end(self, req: Request) -> int:
        """One past the last stored position (0: none)."""
        cur = self._of.get(req)
        return 0 if cur is None else cur[0] + cur[2]

    def get(self, req: Request, start: int, end: int, hidden_size: int, dtype, device) -> torch.Tensor:
        """f_start .. f_{end-1}, their ``cols``, as [end - start, hidden_size] (zeros where nothing is stored)."""
        cur = self._of.get(req)
        if cur is not None and cur[0] <= start and end <= cur[0] + cur[2] and start < end:
            # every row stored (a round's catch-up, always but after a prefix-cache hit): one copy of the rows and
            # columns read, not zeros and a write into them (a round's host work runs cold, ~20 us an op)
            return self._joined(cur)[start - cur[0]:end - cur[0], self.cols].to(
                dtype=dtype, device=device, memory_format=torch.contiguous_format, copy=True)
        out = torch.zeros(end - start, hidden_size, dtype=dtype, device=device)
        if cur is not None:
            s0 = cur[0]
            lo, hi = max(start, s0), min(end, s0 + cur[2])
            if lo < hi:
                out[lo - start:hi - start] = self._joined(cur)[lo - s0:hi - s0, self.cols]
        return out

    def last(self, req: Request) -> tuple[int, torch.Tensor] | None:
        """(position, f) of the last stored position, or None."""
        cur = self._of.get(req)
        if cur is None or not cur[2]:
            return None
        return cur[0] + cur[2] - 1, cur[1][-1][-1, self.cols]

    def drop_before(self, req: Request, pos: int) -> None:
        """Forget positions < pos (consumed): the store stays a few rows a request."""
        cur = self._of.get(req)
        if cur is None or pos <= cur[0]:
            return
        drop = min(pos - cur[0], cur[2])
        cur[0] += drop
        cur[2] -= drop
        chunks = cur[1]
        while drop and drop >= len(chunks[0]):  # whole chunks first, no copy
            drop -= len(chunks.pop(0))
        if drop:
            chunks[0] = chunks[0][drop:]
