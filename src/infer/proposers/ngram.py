"""Prompt lookup: drafts copied from the request's own prompt and output (no model), and the hybrid with a drafter.

NgramProposer (seed 004's copy drafter; Hugging Face's prompt lookup decoding and vLLM's ``ngram`` are the peers):
take the last n tokens of the sequence, n from ``max_n`` down to ``min_n``; if they occurred earlier, propose the
K tokens that followed their most recent earlier occurrence. Edits, summaries and code rewrites repeat long spans
of their context, and a lookup costs microseconds. No match: no drafts, and the row decodes plainly in the same
verify pass. Drafts are deterministic (q = one-hot), verified exactly (spec_decode.verify).

Trees (``propose_tree``): the continuations of up to ``MATCHES`` distinct earlier occurrences (longest n first, then
the most recent), merged into one tree; the first is scored above the others for the cut to the node budget.

The index is kept per request and grows with the sequence: ``{n-gram: position after its latest occurrence}``,
extended by the tokens appended since the last round (a dictionary update per token and n), so a lookup never
rescans the prompt.

HybridProposer: copies where a row has them, the draft model's drafts for the other rows. The copies come from prompt
lookup (proposer "hybrid") or from a suffix tree over this engine's earlier and running requests, each request's own
text included (proposers.suffix; proposer "suffix-hybrid", ArcticInference's suffix decoding beside its speculator):
a loop whose requests repeat earlier ones' text (an agent's tool calls, a JSON format) copies long runs, and new text
goes to the model. The copier's confidences and groups, where it has them (the suffix tree's), price the copies.
"""

from __future__ import annotations

import weakref

import torch

from ..sampling import SamplingBatch
from ..spec_decode.tree import DraftTree
from .base import DraftBatch, Proposal, Proposer, one_hot_q


MATCHES = 4  # earlier occurrences an n-gram remembers (the latest ones), for trees


class _Index:
    def __init__(self, ns: range):
        self.by_n = {n: {} for n in ns}  # n -> {tuple of n tokens: indices of the tokens that followed them, latest last}
        self.upto = 0  # continuation positions < upto are indexed

    def extend(self, seq: list[int]) -> None:
        """Index every n-gram whose continuation position c satisfies upto <= c < len(seq) (the sequence's own
        suffix, continuation len(seq), is not an earlier occurrence)."""
        for c in range(self.upto, len(seq)):
            for n, table in self.by_n.items():
                if c >= n:
                    seen = table.setdefault(tuple(seq[c - n:c]), [])
                    seen.append(c)
                    if len(seen) > MATCHES:
                        del seen[0]
        self.upto = max(self.upto, len(seq))

    def lookup(self, seq: list[int], k: int, matches: int = 1) -> list[list[int]]:
        """Continuations of up to ``matches`` earlier occurrences, longest context first, then the latest."""
        L, found = len(seq), []
        for n in sorted(self.by_n, reverse=True):  # the longest matching context is the most specific
            if L > n:
                for c in reversed(self.by_n[n].get(tuple(seq[L - n:]), [])):
                    cont = seq[c:c + k]
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) == matches:
                            return found
        return found


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.ns = range(min_n, max_n + 1)
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> _Index

    def continuations(self, req, k: int, matches: int = 1) -> list[list[int]]:
        """Up to k tokens that followed each of up to ``matches`` earlier occurrences of the sequence's last n tokens."""
        index = self._index.get(req)
        if index is None:
            index = self._index[req] = _Index(self.ns)
        seq = req.all_ids()
        index.extend(seq)
        return index.lookup(seq, k, matches) if k else []

    def lookup(self, req, k: int) -> list[int]:
        """The chain: up to k tokens after the best (longest, then latest) earlier occurrence ([] if none)."""
        found = self.continuations(req, k)
        return found[0] if found else []

    supports_tree = True

    def tree(self, req, depth: int) -> DraftTree:
        tree = DraftTree(req.last_token)
        for i, cont in enumerate(self.continuations(req, depth, MATCHES)):
            tree.add_path(cont, score=-float(i))  # the best match's nodes first, then the next ones
        return tree

    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        return [self.tree(r, k) for r, k in zip(batch.reqs, batch.ks)]

    def free_drafts(self, req, k: int) -> int:
        return len(self.lookup(req, k))  # every draft is a copy; no match: none (the row decodes plainly)

    def propose(self, batch: DraftBatch) -> Proposal:
        return _proposal([self.lookup(r, k) for r, k in zip(batch.reqs, batch.ks)], batch)


def _sub_batch(batch: DraftBatch, rows: list[int]) -> DraftBatch:
    return DraftBatch([batch.reqs[b] for b in rows], [batch.ks[b] for b in rows],
                      None if batch.sampling is None else
                      SamplingBatch.from_params([batch.sampling.rows[b] for b in rows], batch.vocab_size, batch.device),
                      None if batch.seen is None else batch.seen[rows], [batch.generators[b] for b in rows],
                      batch.vocab_size, batch.device, batch.keep_logits, batch.grammar, batch.confidence)


def _proposal(found: list[list[int]], batch: DraftBatch) -> Proposal:
    K = max(1, batch.K, *map(len, found))
    drafts = torch.tensor([f + [0] * (K - len(f)) for f in found], dtype=torch.long, device=batch.device)  # [B, K]
    nd = [len(f) for f in found]
    return Proposal(drafts, nd, None, None, free=[bool(f) for f in found])


class HybridProposer(Proposer):
    """Copy where the copier offers drafts (free drafts), draft with the model elsewhere. ``copies``: a proposer that
    drafts without a model (NgramProposer, SuffixProposer): ``lookup(req, k)`` -> its chain, [] where it has none."""

    drafts_either_way = True  # a row with a copy on offer can take the model's drafts instead (auto K's choice)

    def __init__(self, copies: Proposer, model: Proposer, name: str = "hybrid", min_copy_score: float = 0.0):
        self.copies, self.model, self.name = copies, model, name
        self.min_copy_score = min_copy_score
        # Request -> (its length, whether its copy pays): auto K's offers decide on the copy at the row's cap, and
        # the proposal at the K chosen (often fewer drafts, a smaller score) keeps that decision, so a row priced as
        # a copy is proposed as one; ``decline`` overrides it where auto K priced the model's drafts higher
        self._decided: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def decline(self, req) -> None:
        """Auto K priced ``req``'s copy below the model's drafts: this round it takes the model's."""
        self._decided[req] = (req.num_tokens, False)

    def _copies_pay(self, conf) -> bool:
        """Whether a copy whose drafts have these confidences (each given the ones before; None: unknown, prompt
        lookup's) is taken over the model's drafts: its expected accepted drafts (the sum of their prefixes'
        probabilities) reach ``min_copy_score``."""
        if conf is None or not self.min_copy_score:
            return True
        run, score = 1.0, 0.0
        for c in conf:
            run *= c
            score += run
        return score >= self.min_copy_score

    def _copy(self, req, k: int) -> list[int]:
        drafts = self.copies.lookup(req, k)
        if not drafts:
            return []
        decided = self._decided.get(req)
        if decided is not None and decided[0] == req.num_tokens:
            return drafts if decided[1] else []
        return drafts if self._copies_pay(self.copies.draft_confidence(req, k)) else []

    @property
    def uses_draft_model(self) -> bool:
        return self.model.uses_draft_model

    @property
    def uses_features(self) -> bool:
        return self.model.uses_features

    def pending(self, req) -> int:
        return self.model.pending(req)

    def free_drafts(self, req, k: int) -> int | None:
        """A copy drafts for free; without one the model drafts (priced)."""
        return len(self._copy(req, k)) or None

    def draft_confidence(self, req, k: int) -> list[float] | None:
        return self.copies.draft_confidence(req, k)

    def confidence_group(self, req, k: int) -> int:
        return self.copies.confidence_group(req, k)

    def offers(self, reqs, ks):
        """The copier's offers (the suffix tree's for the batch in one call), None where it has no copy: the model's
        rows."""
        out = []
        for r, o in zip(reqs, self.copies.offers(reqs, ks)):
            pays = o is not None and o[0] > 0 and self._copies_pay(o[1])
            if o is not None:
                self._decided[r] = (r.num_tokens, pays)
            out.append(o if pays else None)
        return out

    def observe(self, req, start, hidden) -> None:
        self.model.observe(req, start, hidden)

    def finished(self, req) -> None:
        self.copies.finished(req)  # a suffix tree keeps the request's text for the next ones
        self.model.finished(req)

    def clear(self) -> None:
        """Forget what the copier learnt across requests (a suffix tree's text; prompt lookup keeps nothing)."""
        getattr(self.copies, "clear", lambda: None)()

    @property
    def supports_tree(self) -> bool:
        return self.model.supports_tree and self.copies.supports_tree

    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        """The copier's tree where a row has one, the model's tree for the other rows."""
        trees = [t if len(t) == 1 or self._copy(r, k) else DraftTree(r.last_token)
                 for t, r, k in zip(self.copies.propose_tree(batch, width), batch.reqs, batch.ks)]
        rest = [b for b, t in enumerate(trees) if len(t) == 1 and batch.ks[b]]
        if rest:
            for b, t in zip(rest, self.model.propose_tree(_sub_batch(batch, rest), width)):
                trees[b] = t
        return trees

    def warm_steps(self, pool, ctx: int, widths: list[int], rows: int = 1) -> None:
        self.model.warm_steps(pool, ctx, widths, rows)

    def propose(self, batch: DraftBatch) -> Proposal:
        found = [self._copy(r, k) for r, k in zip(batch.reqs, batch.ks)]
        rest = [b for b, f in enumerate(found) if not f and batch.ks[b]]
        if len(rest) == len(found) and not batch.keep_logits:
            # every row the model's (a lone row's head rounds): its proposal as it is, which the merge below would
            # rebuild tensor by tensor (~0.1 ms of a round's host work, cold)
            mp = self.model.propose(batch)
            mp.free = [False] * len(found)
            return mp
        out = _proposal(found, batch)  # q None: copies are deterministic drafts (verified as prompt lookup's)
        if not rest:
            return out
        mp = self.model.propose(_sub_batch(batch, rest))
        out.catch_up, out.catch_up_tokens, out.catch_up_s = mp.catch_up, mp.catch_up_tokens, mp.catch_up_s
        out.model_rows, out.model_steps, out.first_s, out.steps_s = mp.model_rows, mp.model_steps, mp.first_s, mp.steps_s
        rows = torch.tensor(rest, device=batch.device)
        out.drafts[rows, :mp.drafts.shape[1]] = mp.drafts
        for i, b in enumerate(rest):
            out.num_draft[b] = mp.num_draft[i]
        copied = [b for b, f in enumerate(found) if f]
        if batch.keep_logits or (mp.has_q and (copied or len(rest) < len(found))):
            # rows of both kinds (or EGAG's logits): one q [B, K, V], one-hot on the copies (the same law as
            # deterministic drafts: accept t with probability p(t), else draw from p without t)
            out.q = one_hot_q(out.drafts, batch.vocab_size)
            if mp.q is not None:
                out.q[rows] = 0.0
                out.q[rows, :mp.q.shape[1]] = mp.q
            else:  # the model's drafts are deterministic too (a drafter of another vocabulary)
                out.q[rows] = one_hot_q(out.drafts[rows], batch.vocab_size)
        else:  # every row the model's (its q as it is, over a draft vocabulary if so) or every draft deterministic
            out.q, out.q_sub, out.vocab_size = mp._q, mp.q_sub, mp.vocab_size
        if mp.confidence is not None:  # the model's rows' confidences; the copies have none (NaN)
            out.confidence = torch.full(out.drafts.shape, float("nan"), device=batch.device)
            out.confidence[rows, :mp.confidence.shape[1]] = mp.confidence
        if batch.keep_logits and mp.logits is not None:
            out.logits = torch.zeros_like(out.q)
            out.logits[rows, :mp.logits.shape[1]] = mp.logits
        return out
