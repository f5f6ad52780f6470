"""MedusaProposer: K drafts from one hidden state with Medusa-style heads (model.draft_heads.MedusaHeads).

A request of L tokens x_0 .. x_{L-1} has f_{L-2} in the feature store: the target's state whose logits gave its
last token x_{L-1}. Head k maps it to the state whose logits predict x_{L-1+k}: drafts d_1 .. d_K come from heads
1 .. K, all from that one state, with no cache to keep or roll back. Under sampling each draft is a draw from its
head's distribution through the row's sampling pipeline (q kept), so verification stays exact although the heads
do not see each other's drafts.

Trees (``propose_tree``): depth d's candidates come from head d's top tokens, the same for every node of a depth
(the heads see no drafts), kept by path score: Medusa's cartesian tree of the heads' top-k, cut to the best nodes.

A row without the state (none handed over yet) drafts nothing that round: a plain decode step.
"""

from __future__ import annotations

import torch

from ..model.draft_heads import MedusaHeads
from ..spec_decode.tree import DraftTree, grow, top_children
from .base import DraftBatch, DraftDrawer, Proposal, Proposer, score_synced
from .draft_vocab import DraftVocab, PromptVocabs
from .features import FeatureStore


class MedusaProposer(Proposer):
    name = "medusa"
    uses_features = True

    def __init__(self, heads: MedusaHeads, draft_vocab: DraftVocab | None = None):
        self.heads, self.draft_vocab = heads, draft_vocab
        self.features = FeatureStore()
        self._vocab = PromptVocabs(draft_vocab)

    def observe(self, req, start: int, hidden: torch.Tensor) -> None:
        end = start + len(hidden)
        self.features.add(req, end - 1, hidden[-1:, : self.heads.config.hidden_size])  # the last final state only
        self.features.drop_before(req, end - 1)

    def _state(self, req):
        """f_{L-2} if the store holds it (the state whose logits gave the last token), else None."""
        last = self.features.last(req)
        return None if last is None or last[0] != req.num_tokens - 2 else last[1]

    supports_tree = True

    @torch.inference_mode()
    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        trees = [DraftTree(r.last_token) for r in batch.reqs]
        idx = [b for b, r in enumerate(batch.reqs) if batch.ks[b] and self._state(r) is not None]
        if not idx:
            return trees
        f = torch.stack([self._state(batch.reqs[b]) for b in idx]).to(self.heads.dtype)  # [n, H]
        dv = self._vocab(batch.reqs)
        score = dv.logits if dv is not None else self.heads.compute_logits
        depths = [min(batch.ks[b], self.heads.num_heads) for b in idx]
        tops = [top_children(score(self.heads(f, d)), width, dv) for d in range(1, max(depths) + 1)]  # [n, w] each
        later = iter(tops[1:])

        def step(tok, parent_slot):  # every node of a depth gets the same candidates: head d's top tokens
            vals, ids = next(later)
            w = tok.shape[1]
            return vals[:, None].expand(-1, w, -1), ids[:, None].expand(-1, w, -1)

        grow([trees[b] for b in idx], tops[0], step, depths, width)
        return trees

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        reqs = batch.reqs
        ks = list(batch.ks)
        state = [self._state(r) for r in reqs]
        for b in range(len(reqs)):
            ks[b] = 0 if state[b] is None else min(ks[b], self.heads.num_heads)
        drawer = DraftDrawer(batch, self.heads.compute_logits, self._vocab(reqs))
        rows = [b for b in range(len(reqs)) if ks[b]]
        if rows:
            f = torch.stack([state[b] for b in rows]).to(self.heads.dtype)  # [n, H]
            for j in range(max(ks)):
                idx = [b for b in rows if ks[b] > j]
                keep = torch.tensor([i for i, b in enumerate(rows) if ks[b] > j])
                drawer.draw(j, idx, self.heads(f[keep], j + 1))
        return drawer.proposal(ks)

    # -- profiling: one head and its logits, the cost of one draft position -------------------------------------
    def scratch_step(self, slots: list[int] | None, b: int) -> bool:
        f = torch.zeros(b, self.heads.config.hidden_size, dtype=self.heads.dtype, device=self.heads.device)
        score_synced(self.heads(f, 1), self.draft_vocab, self.heads.compute_logits)
        return True
