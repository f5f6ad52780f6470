"""Prompt lookup: drafts copied from the request's own prompt and output (no model), and the hybrid with a drafter.

NgramProposer (seed 004's copy drafter; Hugging Face's prompt lookup decoding and vLLM's ``ngram`` are the peers):
take the last n tokens of the sequence, n from ``max_n`` down to ``min_n``; if they occurred earlier, propose the
K tokens that followed their most recent earlier occurrence. Edits, summaries and code rewrites repeat long spans
of their context, and a lookup costs microseconds. No match: no drafts, and the row decodes plainly in the same
verify pass. Drafts are deterministic (q = one-hot), verified exactly (spec_decode.verify).

The index is kept per request and grows with the sequence: ``{n-gram: position after its latest occurrence}``,
extended by the tokens appended since the last round (a dictionary update per token and n), so a lookup never
rescans the prompt.

HybridProposer: the n-gram's drafts where a row has a match, the draft model's for the other rows.
"""

from __future__ import annotations

import weakref

import torch

from ..sampling import SamplingBatch
from .proposer import DraftBatch, Proposal, Proposer, one_hot_q


class _Index:
    def __init__(self, ns: range):
        self.by_n = {n: {} for n in ns}  # n -> {tuple of n tokens: index of the token that followed them}
        self.upto = 0  # continuation positions < upto are indexed

    def extend(self, seq: list[int]) -> None:
        """Index every n-gram whose continuation position c satisfies upto <= c < len(seq) (the sequence's own
        suffix, continuation len(seq), is not an earlier occurrence)."""
        for c in range(self.upto, len(seq)):
            for n, table in self.by_n.items():
                if c >= n:
                    table[tuple(seq[c - n:c])] = c
        self.upto = max(self.upto, len(seq))

    def lookup(self, seq: list[int], k: int) -> list[int]:
        L = len(seq)
        for n in sorted(self.by_n, reverse=True):  # the longest matching context is the most specific
            if L > n:
                c = self.by_n[n].get(tuple(seq[L - n:]))
                if c is not None:
                    return seq[c:c + k]
        return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.ns = range(min_n, max_n + 1)
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> _Index

    def lookup(self, req, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens."""
        index = self._index.get(req)
        if index is None:
            index = self._index[req] = _Index(self.ns)
        seq = req.all_ids()
        index.extend(seq)
        return index.lookup(seq, k) if k else []

    def propose(self, batch: DraftBatch) -> Proposal:
        found = [self.lookup(r, k) for r, k in zip(batch.reqs, batch.ks)]
        return _proposal(found, batch)


def _proposal(found: list[list[int]], batch: DraftBatch) -> Proposal:
    K = max(1, batch.K)
    drafts = torch.zeros(len(found), K, dtype=torch.long)
    for b, f in enumerate(found):
        drafts[b, :len(f)] = torch.tensor(f, dtype=torch.long)
    nd = [len(f) for f in found]
    drafts = drafts.to(batch.device)
    return Proposal(drafts, nd, None, None)


class HybridProposer(Proposer):
    """Copy where the context offers a match (free drafts), draft with the model elsewhere."""

    name = "hybrid"

    def __init__(self, ngram: NgramProposer, model: Proposer):
        self.ngram, self.model = ngram, model

    @property
    def uses_draft_model(self) -> bool:
        return self.model.uses_draft_model

    @property
    def uses_features(self) -> bool:
        return self.model.uses_features

    def pending(self, req) -> int:
        return self.model.pending(req)

    def observe(self, req, start, hidden) -> None:
        self.model.observe(req, start, hidden)

    def propose(self, batch: DraftBatch) -> Proposal:
        found = [self.ngram.lookup(r, k) for r, k in zip(batch.reqs, batch.ks)]
        rest = [b for b, f in enumerate(found) if not f and batch.ks[b]]
        out = _proposal(found, batch)
        if batch.sampling is not None or batch.keep_logits:
            out.q = one_hot_q(out.drafts, batch.vocab_size)  # [B, K, V], replaced for model rows
        if not rest:
            return out
        sub = DraftBatch([batch.reqs[b] for b in rest], [batch.ks[b] for b in rest],
                         None if batch.sampling is None else
                         SamplingBatch.from_params([batch.sampling.rows[b] for b in rest], batch.vocab_size,
                                                   batch.device),
                         None if batch.seen is None else batch.seen[rest], [batch.generators[b] for b in rest],
                         batch.vocab_size, batch.device, batch.keep_logits)
        mp = self.model.propose(sub)
        out.catch_up, out.catch_up_tokens, out.catch_up_s = mp.catch_up, mp.catch_up_tokens, mp.catch_up_s
        rows = torch.tensor(rest, device=batch.device)
        out.drafts[rows, :mp.drafts.shape[1]] = mp.drafts
        for i, b in enumerate(rest):
            out.num_draft[b] = mp.num_draft[i]
        if mp.q is not None:
            out.q[rows] = 0.0
            out.q[rows, :mp.q.shape[1]] = mp.q
        if batch.keep_logits and mp.logits is not None:
            out.logits = torch.zeros_like(out.q)
            out.logits[rows, :mp.logits.shape[1]] = mp.logits
        return out
