"""EagleProposer: drafts with an EAGLE-style feature head (model.draft_heads: EagleHead, Eagle3Head) from the target's
hidden states.

Alignment. A request of L tokens x_0 .. x_{L-1} in decode has the target's cache at L - 1 and, in the feature store,
the target's f_i for the positions it computed (f_i predicted x_{i+1}). The head's entry at position i is
fc([embed(x_{i+1}); f_i]); its output predicts f_{i+1}. So its own cache (one layer in the draft pool) holds
entries 0 .. L-2 built from *true* features, and drafting continues from there:

  catch up   entries fed .. L-2 from the store (normally the last round's accepted run: 1 .. K+1 of them)
             -> f^_{L-1} -> draft d_1 (the guess for x_L)
  step j     entry L-2+j = fc([embed(d_j); f^_{L-2+j}]) -> f^_{L-1+j} -> d_{j+1}

Over a draft vocabulary, greedy or sampled at a temperature (rows with top-k / top-p / min-p draw from their plain
temperature law there: base.temperature_law_drafts), a lone row's round with an EAGLE-3 head the C++ op runs
(quantized, bfloat16, a paged draft pool) is one call of it, every step included (Eagle3Head.native_round). Else a
round whose rows all draft >= 2 runs its catch-up, the
draw of d_1 and up to CHAIN_MAX steps as one compiled call (EagleHead.draft_round), and any later steps as chains
(EagleHead.draft_chain). Otherwise the first step runs apart with an eager draw (DraftDrawer), followed by chains
where the vocabulary and sampling allow them, else by single steps.

Trees (``propose_tree``): the same catch-up gives f^_{L-1} and the root's top children; each further depth feeds the
frontier's nodes as entries at one position (L-2 + their depth), each with its parent's predicted feature and a
tree mask over the nodes fed this round (its ancestors), in one head forward a depth.

EAGLE-3 (Eagle3Head) follows the same alignment with two differences: the true f_i are the target's captured
layers (fused by the head's fc), and f^ is the head's own output (a free hidden state scored by its own head over its
draft vocabulary, HeadVocab), which the next draft entry reads as its hidden.

Entries built from predicted features (positions >= L-1) are dropped at the next round, which rebuilds them from
the target's true features of the accepted tokens: the head's cache is truncated to what it ``fed`` from true
features (a length, the KV manager's ``draft_fed``; no copy). The draft pool is rolled back with the target's as for
any drafter; this truncation only shortens it further. With the prefix cache, a prompt's entries over a cached
prefix come with its draft blocks (kv_manager): ``draft_fed`` starts at the hit, and the catch-up feeds from there.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..cache.base import TreeAttn
from ..cache.paged import PagedKVCachePool
from ..model.draft_heads import Eagle3Head, EagleHead
from ..spec_decode.tree import DraftTree, FrontierFeed, grow, top_children
from .base import DraftBatch, DraftDrawer, Proposal, Proposer, round_uniforms, score_synced, temperature_law_drafts
from .draft_model import CATCH_UP_BATCHED  # longer catch-ups (a prompt) are fed alone first
from .draft_vocab import DraftVocab, HeadVocab, PromptVocabs
from .features import FeatureStore

# The most draft steps one chain runs (EagleHead.draft_chain: one compiled graph per length 1 .. CHAIN_MAX, built
# by engine.warmup); a longer run of steps goes in several chains. 0: a step at a time (benchmarks/draft_chain.py).
CHAIN_MAX = 3


class EagleProposer(Proposer):
    name = "eagle"
    uses_draft_model = True
    uses_features = True
    fused = True  # a round's first step and its chain in one compiled call (False: apart, for A/B)
    native = True  # a lone row's EAGLE-3 round in one C++ call where the head allows it (False: compiled, for A/B)

    def __init__(self, head: EagleHead | Eagle3Head, kv, draft_vocab: DraftVocab | None = None):
        if isinstance(head, Eagle3Head):
            draft_vocab = HeadVocab(head)  # its own head over its own draft vocabulary, whatever was asked
        self.head, self.kv, self.draft_vocab = head, kv, draft_vocab
        H = head.config.hidden_size
        # what of the target's hidden [n, (1 + captured) H] the head reads: the final state (EAGLE), or the layers
        # captured after it (EAGLE-3)
        self._cols = slice(H, None) if isinstance(head, Eagle3Head) else slice(0, H)
        self._width = head.feature_width if isinstance(head, Eagle3Head) else H
        self.features = FeatureStore(self._cols)
        self._vocab = PromptVocabs(draft_vocab)

    def observe(self, req, start: int, hidden: torch.Tensor) -> None:
        self.features.add(req, start, hidden)  # the head's columns are cut where a round reads them

    def _native(self, pool, vocab) -> bool:
        """Whether a lone row's round runs as one C++ call (Eagle3Head.native_round): an EAGLE-3 head the op runs
        (quantized to a block type, bfloat16, on the CPU), its own draft vocabulary, a paged draft pool."""
        return self.native and isinstance(self.head, Eagle3Head) and isinstance(vocab, HeadVocab) and \
            vocab._head is self.head and isinstance(pool, PagedKVCachePool) and self.head.native_round_ready()

    def lone_round_native(self) -> bool:
        return self._native(self.kv.draft_pool, self._vocab.widened(self.draft_vocab))

    def _fed_len(self, req) -> int:
        return self.kv.draft_fed(req)  # entries from true features (a prefix hit's included)

    @torch.inference_mode()
    def release(self, req) -> None:
        """Before ``req``'s draft slot is freed and its blocks offered to the prefix cache (KVManager.free): feed the
        entries its true states allow that no round fed (the plain steps since its last round; all of them for a row
        that never drafted), so its blocks cover what the target's do and a later prompt over them is not fed zeros.
        Module forwards (a few ms for hundreds of entries), eager: a compiled step would compile for a width no graph
        covers in the finishing request's step (~2.5 s on SmolLM2, 2 cores); skipped where the draft pool lacks the
        room."""
        end, slot = req.num_tokens - 1, self.kv.draft_slot(req)
        fed = self._fed_len(req)
        if end <= fed or not self.kv.draft_pool.can_fit([(slot, end)]):
            return
        toks, feats, _ = self._catch_up([req], [slot])
        self._forward([slot], toks, feats, eager=True)

    def pending(self, req) -> int:
        return max(0, req.num_tokens - 1 - self._fed_len(req) - 2)

    def _forward(self, slots: list[int], tokens: list[list[int]], feats: list[torch.Tensor],
                 tree: TreeAttn | None = None, pool=None, eager: bool = False) -> torch.Tensor:
        """Append entries (tokens x_{i+1}, features f_i) to the head's slots in one padded forward -> [n, T, H]
        (``pool``: another than the draft pool, for warm_steps; ``eager``: never a compiled step)."""
        pool, dev = pool or self.kv.draft_pool, self.head.device
        x, f = self._padded(tokens, feats)
        meta = pool.prepare(slots, [len(t) for t in tokens], dev, tree)
        return self.head(x, f, meta.positions, pool, meta, eager=eager)

    def _padded(self, tokens: list[list[int]], feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of entries -> tokens [n, T] and features [n, T, W], zero-padded to the longest row."""
        T, dev = max(len(t) for t in tokens), self.head.device
        if len(tokens) == 1 and feats[0].dtype == self.head.dtype and feats[0].device == dev:
            # a lone row needs no padding: two ops, not six (a round's host work runs cold, ~10-20 us an op)
            return torch.tensor(tokens, device=dev), feats[0][None]
        x = torch.zeros(len(tokens), T, dtype=torch.long)
        # true features (catch-up entries) or the previous step's outputs (draft entries): one kind per call
        f = torch.zeros(len(tokens), T, feats[0].shape[-1], dtype=self.head.dtype, device=dev)
        for i, (t, h) in enumerate(zip(tokens, feats)):
            x[i, :len(t)] = torch.as_tensor(t)
            f[i, :len(t)] = h
        return x.to(dev), f

    def _catch_up(self, reqs, slots: list[int],
                  native: bool = False) -> tuple[list[list[int]], list[torch.Tensor], int]:
        """Entries fed .. L-2 of each row from true features; rows longer than CATCH_UP_BATCHED feed all but their
        last entry alone. Returns each row's remaining (tokens, features) and the entries fed alone.

        ``native``: a lone row whose round is one C++ call (``_native``) feeds them through that call too (one draft
        step after them drawn and dropped): it writes the entries' keys and values and runs the layer's attention and
        MLP for the last one only, where the module runs them for every entry (a prompt of 80: 0.78 against 1.94 ms),
        and writes the same bits (kernels/eagle_round.cpp)."""
        pool, head = self.kv.draft_pool, self.head
        toks, feats, alone = [], [], 0
        for r, slot in zip(reqs, slots):
            fed, end = self._fed_len(r), r.num_tokens - 1
            pool.truncate_to(slot, fed)  # entries past fed came from predicted features
            t = r.token_slice(fed + 1, end + 1)
            f = self.features.get(r, fed, end, self._width, head.dtype, head.device)
            self.kv.set_draft_fed(r, end)
            self.features.drop_before(r, end)
            if len(t) > CATCH_UP_BATCHED:
                if native:
                    start = pool.extend(slot, len(t) - 1)
                    head.native_round(torch.tensor(t[:-1]), f[:-1], pool, slot, start, torch.zeros(1),
                                      torch.zeros(1, 1, dtype=torch.float64))
                else:
                    self._forward([slot], [t[:-1]], [f[:-1]])
                alone += len(t) - 1
                t, f = t[-1:], f[-1:]
            toks.append(t)
            feats.append(f)
        return toks, feats, alone

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        reqs, ks = batch.reqs, list(batch.ks)
        for b, r in enumerate(reqs):
            if r.num_tokens - 1 <= self._fed_len(r):  # no entry to feed: a one-token prompt before its first step
                ks[b] = 0
        dslots = [self.kv.draft_slot(r) for r in reqs]
        drawer = DraftDrawer(batch, self.head.compute_logits, self._vocab(reqs))
        idx = [b for b in range(len(reqs)) if ks[b] > 0]
        if not idx:
            return drawer.proposal(ks)
        pool, dev = self.kv.draft_pool, self.head.device
        # over a draft vocabulary, greedy or sampled at a temperature (top-k / top-p rows too, drafting from their
        # plain temperature law: temperature_law_drafts): runs of later steps go as one chain
        chain = CHAIN_MAX > 0 and batch.grammar is None and not batch.keep_logits and drawer.dv is not None and \
            (batch.sampling is None or temperature_law_drafts(batch.sampling))
        native = chain and len(idx) == 1 and self._native(pool, drawer.dv)
        t0 = time.perf_counter()
        toks, feats, alone = self._catch_up([reqs[b] for b in idx], [dslots[b] for b in idx], native)
        catch_up_s = time.perf_counter() - t0 if alone else 0.0
        catch_up = max(len(t) for t in toks)
        j, prev_idx = 0, None
        if native:
            # a lone row's whole round (catch-up, first draw, every later step) in one C++ call; with a stop (auto K),
            # as many drafts as the head's confidence carries, up to the stop's cap
            b, slot = idx[0], dslots[idx[0]]
            stop = batch.stop if len(reqs) == 1 else None
            m = (max(ks[b], stop.cap) if stop is not None else ks[b]) - 1
            start = pool.extend(slot, len(toks[0]) + m)
            temp, u = round_uniforms(batch, idx, m + 1, dev)
            drafts, _, q, conf = self.head.native_round(torch.tensor(toks[0]), feats[0], pool, slot, start, temp, u,
                                                        None if stop is None else (stop.cal, stop.below))
            if drafts.shape[1] != ks[b]:  # the round's own length: the drawer's shapes follow it
                ks[b] = drafts.shape[1]
                drawer.batch = dataclasses.replace(batch, ks=list(ks))
                pool.truncate_to(slot, start + len(toks[0]) + ks[b] - 1)  # entries past the last draft: none written
            drawer.put(0, idx, drafts, q, conf)
            j = ks[b]
        while j < max(ks):
            idx = [b for b in range(len(reqs)) if ks[b] > j]
            if j == 0 and chain and self.fused and min(ks[b] for b in idx) > 1 and \
                    not (len(idx) == 1 and pool.seq_len(dslots[idx[0]]) == 0 and len(toks[0]) > 1):
                # the round's first step and a chain in one compiled call (~0.3-0.4 ms less than the two calls and
                # the eager draw between them; a first step alone is no faster fused); a fresh causal fill: eager
                m = min(min(ks[b] for b in idx) - 1, CHAIN_MAX)  # the later steps every row takes, up to a chain's
                slots = [dslots[b] for b in idx]
                metas = [pool.prepare(slots, [len(t) for t in toks], dev)] + pool.prepare_run(slots, m, dev)
                temp, u = round_uniforms(batch, idx, m + 1, dev)
                x, f = self._padded(toks, feats)
                last = torch.tensor([len(t) - 1 for t in toks], device=dev)
                drafts, f_hat, q = self.head.draft_round(x, f, last, pool, metas, drawer.dv, temp, u)
                drawer.put(0, idx, drafts, q)
                j, prev_idx = m + 1, idx
                continue
            if j == 0:
                out = self._forward([dslots[b] for b in idx], toks, feats)
                f_hat = out[torch.arange(len(idx)), torch.tensor([len(t) - 1 for t in toks])]  # [n, H]
                drawer.draw(0, idx, f_hat)
                j += 1
                prev_idx = idx
                continue
            keep = [i for i, b in enumerate(prev_idx) if ks[b] > j]
            if len(keep) < len(prev_idx):
                f_hat = f_hat[keep]
            slots, last = [dslots[b] for b in idx], drawer.drafts[idx, j - 1]
            if chain:  # the steps every row of idx takes, up to CHAIN_MAX at once (a graph each length)
                m = min(min(ks[b] for b in idx) - j, CHAIN_MAX)
                metas = pool.prepare_run(slots, m, dev)
                temp, u = round_uniforms(batch, idx, m, dev)
                drafts, f_hat, q = self.head.draft_chain(last, f_hat, pool, metas, drawer.dv, temp, u)
                drawer.put(j, idx, drafts, q)
                j += m
            else:  # one entry a row: the last draft and f^ of the step before, as tensors (no host sync)
                meta = pool.prepare(slots, [1] * len(idx), dev)
                f_hat = self.head(last[:, None], f_hat[:, None], meta.positions, pool, meta)[:, 0]
                drawer.draw(j, idx, f_hat)
                j += 1
            prev_idx = idx
        return drawer.proposal(ks, catch_up=catch_up, catch_up_tokens=alone, catch_up_s=catch_up_s)

    supports_tree = True

    @torch.inference_mode()
    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        reqs = batch.reqs
        trees = [DraftTree(r.last_token) for r in reqs]
        idx = [b for b, r in enumerate(reqs) if batch.ks[b] > 0 and r.num_tokens - 1 > self._fed_len(r)]
        if not idx:
            return trees
        rows, pool = [reqs[b] for b in idx], self.kv.draft_pool
        slots = [self.kv.draft_slot(r) for r in rows]
        toks, feats, _ = self._catch_up(rows, slots)
        out = self._forward(slots, toks, feats)
        f_root = out[torch.arange(len(idx)), torch.tensor([len(t) - 1 for t in toks])]  # f^_{L-1} [n, H]
        dv = self._vocab(reqs)
        score = dv.logits if dv is not None else self.head.compute_logits
        base = [pool.seq_len(s) for s in slots]  # the tree's first column: position L-1
        depths = [batch.ks[b] for b in idx]
        feed, st = FrontierFeed(base, width * (max(depths) - 1), self.head.device), {"f": f_root[:, None]}

        def step(tok, parent_slot):  # feed the frontier: entry L-2+j = fc([embed(node); f^ of its parent]), depth j
            pick, attn = feed.plan(tok, parent_slot)
            f = st["f"].gather(1, pick[:, :, None].expand(*pick.shape, st["f"].shape[2]))  # [n, w, H]
            st["f"] = self._forward(slots, tok.tolist(), list(f), attn)  # [n, w, H]
            return top_children(score(st["f"]), width, dv)

        grow([trees[b] for b in idx], top_children(score(f_root), width, dv), step, depths, width)
        for s, b0 in zip(slots, base):  # the tree's entries came from predicted features: never kept
            pool.truncate_to(s, b0)
        return trees

    # -- profiling --------------------------------------------------------------------------------------------
    def _zeros(self, n: int, width: int | None = None) -> torch.Tensor:
        return torch.zeros(n, width or self.head.config.hidden_size, dtype=self.head.dtype, device=self.head.device)

    def scratch_fill(self, slots: list[int], n: int) -> None:
        self._forward(slots, [[1] * n] * len(slots), [self._zeros(n, self._width)] * len(slots))

    def scratch_step(self, slots: list[int] | None, b: int) -> bool:
        f_hat = self._forward(slots[:b], [[1]] * b, [self._zeros(1)] * b)[:, -1]
        score_synced(f_hat, self.draft_vocab, self.head.compute_logits)
        return True

    def warm_steps(self, pool, ctx: int, widths: list[int], rows: int = 1) -> None:
        """Run on ``pool`` (a twin of the draft pool) what rounds run: catch-ups of each width from true features,
        each followed by a draft step from the head's own output, the same fused with the chains of each length after
        it (``draft_round``), and chains of the later steps' lengths (a graph each, whatever the vocabulary and
        sampling) (engine.warmup builds their compiled graphs), for ``rows`` rows
        at once (contexts of ctx, ctx + 1, ...: masked steps, as a served batch's), and then one of those rows alone
        (its blocks interleaved with the others'). A lone row whose rounds run as one C++ call (``_native``) needs
        only the single steps (a long catch-up's, a tree's, a step whose draw the chain cannot make)."""
        lens = [ctx + i for i in range(rows)]
        chains = range(1, min(CHAIN_MAX, max(widths) - 2) + 1)  # a round's later steps: K - 1, K <= max(widths) - 1
        vocab = self._vocab.widened(self.draft_vocab)
        chains = chains if vocab is not None else []
        native = self._native(pool, vocab)  # a lone row's rounds are one C++ call: its rounds' graphs never run
        slots = [pool.allocate(n + max(widths) + 1) for n in lens]
        try:
            self._forward(slots, [[1] * n for n in lens], [self._zeros(n, self._width) for n in lens], pool=pool)
            for sub in ([slots, slots[:1]] if rows > 1 else [slots]):
                for t in widths:
                    out = self._forward(sub, [[1] * t] * len(sub), [self._zeros(t, self._width)] * len(sub), pool=pool)
                    self._forward(sub, [[1]] * len(sub), list(out[:, -1:]), pool=pool)
                    for s, n in zip(sub, lens):
                        pool.truncate_to(s, n)
                if native and len(sub) == 1:
                    continue
                tok = torch.ones(len(sub), dtype=torch.long, device=self.head.device)
                temp = torch.ones(len(sub), device=self.head.device)
                for t in (widths if chains else []):  # fused rounds: a catch-up of t entries and m chained steps
                    x, f = self._padded([[1] * t] * len(sub), [self._zeros(t, self._width)] * len(sub))
                    last = torch.full((len(sub),), t - 1, dtype=torch.long, device=self.head.device)
                    for m in chains:
                        metas = [pool.prepare(sub, [t] * len(sub), self.head.device)] + \
                            pool.prepare_run(sub, m, self.head.device)
                        u = torch.full((len(sub), m + 1), 0.5, dtype=torch.float64, device=self.head.device)
                        self.head.draft_round(x, f, last, pool, metas, vocab, temp, u)
                        for s, n in zip(sub, lens):
                            pool.truncate_to(s, n)
                for m in chains:
                    metas = pool.prepare_run(sub, m, self.head.device)
                    u = torch.full((len(sub), m), 0.5, dtype=torch.float64, device=self.head.device)
                    self.head.draft_chain(tok, self._zeros(len(sub)), pool, metas, vocab, temp, u)
                    for s, n in zip(sub, lens):
                        pool.truncate_to(s, n)
        finally:
            for s in slots:
                pool.free(s)
