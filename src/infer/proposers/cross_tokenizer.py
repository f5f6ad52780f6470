"""CrossTokenizerProposer: a drafter with a tokenizer of its own drafts for any target (Timor et al., ICML 2025).

The drafter reads the request's text re-encoded in its own tokens (proposers.vocab_bridge.DraftText) and keeps its
KV in a pool of its own (``own_pool``): its positions do not follow the target's, so the KV manager's lockstep
draft pool does not apply. Two algorithms (``method``):

- "string" (string-level exact match): the drafter continues the text greedily in its own tokens until the
  target's tokenization of what it wrote holds k + 1 tokens (so the k-th is whole), or it ends the text, or it has
  taken 2k + 2 steps; the drafts are the first k of those target tokens. They are deterministic, and the round
  judges them exactly (accept t with probability p(t), else draw from p without t): lossless at any temperature,
  and any target token can be proposed, a word the target spells in one token among them.
- "intersection" (token-level intersection): the drafter's distribution restricted to the tokens both
  vocabularies have (same bytes), renormalised, is q; drafts are drawn from it and judged by speculative sampling
  as any drafter's (exact for any q). One drafter step per draft; only shared tokens can be proposed.

Either way the output is the target's: the drafts are proposals only.
"""

from __future__ import annotations

import time

import torch

from ..model.layers import linear
from ..sampling import argmax
from .base import DraftBatch, DraftDrawer, Proposal, Proposer, one_hot_q
from .draft_model import CATCH_UP_BATCHED
from .draft_vocab import DraftVocab
from .vocab_bridge import DraftText, VocabBridge

METHODS = ("string", "intersection")


class SharedVocab(DraftVocab):
    """The drafter's scores over the shared tokens: column j is target token ``ids[j]`` (ascending), scored by the
    drafter's lm-head row of its twin; the sampling pipeline then sees -inf outside them (``expand``)."""

    def __init__(self, drafter, bridge: VocabBridge, target_vocab: int):
        dev = drafter.device
        tids = (bridge.t2d >= 0).nonzero().flatten()
        self.vocab_size, self.id_list = target_vocab, tids.tolist()
        self.ids = tids.to(dev)
        self.weight = drafter.lm_head_weight[bridge.t2d[tids].to(dev)].contiguous()  # [N, H]
        self.head = self.extra_weight = None

    def including(self, token_ids) -> DraftVocab:
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight).float()


class CrossTokenizerProposer(Proposer):
    name = "cross-tokenizer"

    def __init__(self, drafter, bridge: VocabBridge, pool, forward, target_vocab: int, method: str = "string"):
        """``pool``: the drafter's own KV pool; ``forward(model, pool, slots, rows)`` -> hidden [B, T, H]."""
        if method not in METHODS:
            raise ValueError(f"cross_tokenizer must be one of {METHODS}, got {method!r}")
        self.drafter, self.bridge, self.own_pool, self.forward, self.method = drafter, bridge, pool, forward, method
        self.shared = SharedVocab(drafter, bridge, target_vocab) if method == "intersection" else None
        self.t2d = bridge.t2d.to(drafter.device)
        self._text: dict[str, DraftText] = {}
        self._slot: dict[str, int] = {}
        self._fed: dict[str, list[int]] = {}  # the drafter tokens the slot's cache holds

    # -- per request state --------------------------------------------------------------------------------------
    def pending(self, req) -> int:
        st = self._text.get(req.request_id)
        return req.num_tokens if st is None else max(0, req.num_tokens - st.n_target - 2)

    def finished(self, req) -> None:
        self._text.pop(req.request_id, None)
        self._fed.pop(req.request_id, None)
        slot = self._slot.pop(req.request_id, None)
        if slot is not None:
            self.own_pool.free(slot)

    def _prepare(self, batch: DraftBatch, steps: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
        """Bring each drafting row's text and cache up to date -> (rows, their slots, the tokens each must feed).
        A row whose text (plus ``steps[b]`` drafter steps) the pool cannot hold drafts nothing."""
        pool, live = self.own_pool, {r.request_id for r in batch.reqs}
        rows = []  # (b, slot, the text's drafter ids, how many of them the cache holds)
        for b, (req, k) in enumerate(zip(batch.reqs, batch.ks)):
            if not k:
                continue
            rid = req.request_id
            st = self._text.setdefault(rid, DraftText())
            known = len(st.stable)  # final tokens before this sync: the cache agrees with them
            ids = self.bridge.sync(st, req.token_slice(st.n_target))
            if st.pending or not ids:  # mid-character (the draft text would start inside it), or no text yet
                continue
            if rid not in self._slot:
                if not pool.can_fit([(None, len(ids) + steps[b])]):
                    for other in [o for o in self._slot if o not in live]:  # requests not decoding now give way
                        self.finished(_Id(other))
                if not pool.can_fit([(None, len(ids) + steps[b])]):
                    continue
                self._slot[rid], self._fed[rid] = pool.allocate(len(ids) + steps[b]), []
            fed = self._fed[rid]
            n = min(known, len(fed))
            while n < len(fed) and n < len(ids) and fed[n] == ids[n]:
                n += 1
            rows.append((b, self._slot[rid], ids, min(n, len(ids) - 1)))  # at least the last token is fed
        while rows and not pool.can_fit([(slot, len(ids) + steps[b]) for b, slot, ids, _ in rows]):
            rows.pop()  # the pool is full: the last rows draft nothing this round
        for b, slot, ids, n in rows:
            pool.truncate_to(slot, min(n, pool.seq_len(slot)))
            self._fed[batch.reqs[b].request_id] = list(ids)  # once fed (the first step)
        return [r[0] for r in rows], [r[1] for r in rows], [r[2][r[3]:] for r in rows]

    def _first_step(self, slots: list[int], feeds: list[list[int]]) -> tuple[torch.Tensor, int, int, float]:
        """Feed each row's new tokens (a long catch-up alone first) -> (hidden at each row's last, the longest feed
        of the batched step, tokens fed alone, their seconds)."""
        t0, fed = time.perf_counter(), 0
        rows = []
        for slot, r in zip(slots, feeds):
            if len(r) > CATCH_UP_BATCHED:
                self.forward(self.drafter, self.own_pool, [slot], [r[:-1]])
                fed, r = fed + len(r) - 1, r[-1:]
            rows.append(r)
        catch_up_s = time.perf_counter() - t0 if fed else 0.0
        hidden = self.forward(self.drafter, self.own_pool, slots, rows)
        last = hidden[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]  # [n, H]
        return last, max(len(r) for r in rows), fed, catch_up_s

    def _step(self, slots: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One drafter token a row (``tokens`` [n], drafter ids) -> hidden [n, H]."""
        meta = self.own_pool.prepare(slots, [1] * len(slots), self.drafter.device)
        return self.drafter(tokens[:, None], meta.positions, self.own_pool, meta)[:, 0]

    # -- drafting ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        if self.method == "intersection":
            return self._propose_shared(batch)
        return self._propose_string(batch)

    def _propose_string(self, batch: DraftBatch) -> Proposal:
        B, K = len(batch.reqs), batch.K
        t_start = time.perf_counter()
        caps = [2 * k + 2 for k in batch.ks]  # drafter steps a row may take
        idx, slots, feeds = self._prepare(batch, caps)
        drafts = torch.zeros(B, K, dtype=torch.long)
        num_draft = [0] * B
        catch_up = fed = 0
        catch_up_s = t_first = 0.0
        if idx:
            last, catch_up, fed, catch_up_s = self._first_step(slots, feeds)
            t_first = time.perf_counter()
            written: list[list[int]] = [[] for _ in idx]  # each row's continuation, drafter ids
            active = list(range(len(idx)))
            for s in range(max(caps[b] for b in idx)):
                tok = argmax(self.drafter.compute_logits(last))  # [n]
                still = []
                for i, t in zip(active, tok.tolist()):
                    b = idx[i]
                    written[i].append(t)
                    ids, ended = self.bridge.draft_to_target(written[i])
                    if ended or len(ids) > batch.ks[b] or len(written[i]) >= caps[b]:
                        # the last target token of unfinished text may be a word's start: kept only at an end
                        n = len(ids) if ended or len(ids) > batch.ks[b] else max(1, len(ids) - 1)
                        ids = ids[:min(n, batch.ks[b])]
                        drafts[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                        num_draft[b] = len(ids)
                    else:
                        still.append(i)
                if not still:
                    break
                pos = [active.index(i) for i in still]
                active = still
                last = self._step([slots[i] for i in active], tok[pos])
            for i, b in enumerate(idx):  # the cache holds every written token but the last
                self._fed[batch.reqs[b].request_id] += written[i][:-1]
        t_end = time.perf_counter()
        drafts = drafts.to(batch.device)
        q = one_hot_q(drafts, batch.vocab_size) if batch.sampling is not None else None
        timing = {} if not idx else dict(model_rows=len(idx), model_steps=max(1, max(num_draft)),
                                         first_s=max(0.0, t_first - t_start - catch_up_s), steps_s=t_end - t_first)
        return Proposal(drafts, num_draft, q, None, catch_up=catch_up, catch_up_tokens=fed, catch_up_s=catch_up_s,
                        **timing)

    def _propose_shared(self, batch: DraftBatch) -> Proposal:
        B, K = len(batch.reqs), batch.K
        drawer = DraftDrawer(batch, None, self.shared)
        idx, slots, feeds = self._prepare(batch, list(batch.ks))
        num_draft = [0] * B
        catch_up = fed = 0
        catch_up_s = 0.0
        rows = list(range(len(idx)))  # positions in idx
        for j in range(K):
            rows = [i for i in rows if batch.ks[idx[i]] > j]
            if not rows:
                break
            if j == 0:
                last, catch_up, fed, catch_up_s = self._first_step(slots, feeds)
            else:  # the drafts before, as the drafter's twins (no host sync inside the loop)
                prev = drawer.drafts[[idx[i] for i in rows], j - 1]
                last = self._step([slots[i] for i in rows], self.t2d[prev])
            drawer.draw(j, [idx[i] for i in rows], last)
        host = drawer.drafts.tolist()
        for i, b in enumerate(idx):
            num_draft[b] = batch.ks[b]
            self._fed[batch.reqs[b].request_id] += [int(self.bridge.t2d[t]) for t in host[b][:batch.ks[b] - 1]]
        return drawer.proposal(num_draft, catch_up=catch_up, catch_up_tokens=fed, catch_up_s=catch_up_s)

    # -- profiling (the cost model prices a draft step on the own pool: spec_decode.setup.measure_costs) ---------
    def scratch_fill(self, slots: list[int], n: int) -> None:
        self.forward(self.drafter, self.own_pool, slots, [[1] * n] * len(slots))

    def scratch_step(self, slots: list[int] | None, b: int) -> bool:
        hidden = self.forward(self.drafter, self.own_pool, slots[:b], [[1]] * b)[:, -1]
        score = self.shared.logits if self.shared is not None else self.drafter.compute_logits
        score(hidden).max(-1).indices.tolist()
        return True


class _Id:
    """A stand-in with a request_id (finished() of a request that is not at hand)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
