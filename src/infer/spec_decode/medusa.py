"""MedusaProposer: K drafts from one hidden state with Medusa-style heads (model.draft_heads.MedusaHeads).

A request of L tokens x_0 .. x_{L-1} has f_{L-2} in the feature store: the target's state whose logits gave its
last token x_{L-1}. Head k maps it to the state whose logits predict x_{L-1+k}: drafts d_1 .. d_K come from heads
1 .. K, all from that one state, with no cache to keep or roll back. Under sampling each draft is a draw from its
head's distribution through the row's sampling pipeline (q kept), so verification stays exact although the heads
do not see each other's drafts.

A row without the state (none handed over yet) drafts nothing that round: a plain decode step.
"""

from __future__ import annotations

import torch

from ..model.draft_heads import MedusaHeads
from .draft_vocab import DraftVocab, PromptVocabs
from .features import FeatureStore
from .proposer import DraftBatch, DraftDrawer, Proposal, Proposer, score_synced


class MedusaProposer(Proposer):
    name = "medusa"
    uses_features = True

    def __init__(self, heads: MedusaHeads, draft_vocab: DraftVocab | None = None):
        self.heads, self.draft_vocab = heads, draft_vocab
        self.features = FeatureStore()
        self._vocab = PromptVocabs(draft_vocab)

    def observe(self, req, start: int, hidden: torch.Tensor) -> None:
        end = start + len(hidden)
        self.features.add(req, end - 1, hidden[-1:])  # only the last state is ever read
        self.features.drop_before(req, end - 1)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        reqs = batch.reqs
        ks = list(batch.ks)
        state = []
        for b, r in enumerate(reqs):
            last = self.features.last(r)
            if last is None or last[0] != r.num_tokens - 2:  # not the state of the last token's prediction
                ks[b] = 0
            ks[b] = min(ks[b], self.heads.num_heads)
            state.append(last[1] if last is not None else None)
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
