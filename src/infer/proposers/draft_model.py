"""DraftModelProposer: a small model of the same vocabulary drafts K tokens per row, batched.

Its KV lives in the KV manager's draft pool, allocated, rolled back and freed in lockstep with the target's. Its
prefill is lazy: a row's first draft step feeds whatever of the sequence the drafter has not seen (the whole prompt
the first time, after a preemption, after rounds drafted by another proposer; normally just the last token, or two
after a bonus). Rows that have drafted their K drop out of later steps.

Trees (``propose_tree``): the same first step, then one step a depth over the frontier's nodes with a tree mask
(spec_decode.tree.FrontierFeed); the tree's entries are dropped afterwards (a length), so the drafter's cache holds
the sequence only, and the next round's first step feeds the accepted path.

With a draft vocabulary (proposers.draft_vocab) the drafter scores only a subset S of tokens, united with the
prompts' own tokens (code copies identifiers from its context): q(x) = 0 outside S, which stays lossless.

A lone row's round (greedy, or drawn from its plain temperature law: base.temperature_law_drafts) over a quantized
bfloat16 drafter and vocabulary in a paged draft pool runs as one C++ call (kernels/lm_round.cpp), the catch-up
entries, the first draw and every later step in it: the same kernels, so the same drafts as the steps below, without
a compiled step's entry, its plan and the draw's ops, each run cold after a verify (~1.3 ms a draft step of SmolLM2's
distilled LM before: issue 33's c).
"""

from __future__ import annotations

import time

import torch

from .. import kernels
from ..cache.paged import PagedKVCachePool
from ..model.llama import LlamaForCausalLM
from ..model.quant import BlockLinear
from ..spec_decode.tree import DraftTree, FrontierFeed, grow, top_children
from .base import DraftBatch, DraftDrawer, Proposal, Proposer, round_uniforms, score_synced, temperature_law_drafts
from .draft_vocab import DraftVocab, PromptVocabs

# Most tokens a row brings to the batched first draft step: usually 1 or 2 (after a bonus the drafter never saw the
# last draft), a few after rounds at K = 0. A longer catch-up (a prompt) is fed alone first: padding every row of the
# batch to its length would cost B prompts, one more forward costs ~one draft step.
CATCH_UP_BATCHED = 16


class DraftModelProposer(Proposer):
    name = "draft"
    uses_draft_model = True
    native = True  # a lone row's round in one C++ call where the drafter allows it (False: its steps, for A/B)
    _native_args: tuple | None = None  # (the op's weight arguments,) once checked; () where it cannot run the drafter

    def __init__(self, drafter: LlamaForCausalLM, kv, forward, draft_vocab: DraftVocab | None = None):
        """``kv``: the KV manager (draft pool and slots); ``forward(model, pool, slots, rows)`` -> hidden [B, T, H]."""
        self.drafter, self.kv, self.forward, self.draft_vocab = drafter, kv, forward, draft_vocab
        self._vocab = PromptVocabs(draft_vocab)

    def pending(self, req) -> int:
        return max(0, req.num_tokens - self.kv.draft_pool.seq_len(self.kv.draft_slot(req)) - 2)

    def _catch_up(self, slots: list[int], rows: list[list[int]]) -> tuple[list[list[int]], int]:
        """Feed a long catch-up (a lazy prefill) row by row, all but its last token: in the batched first step every
        row is padded to the longest, so one new request's prompt would cost B prompts. Returns what is left to feed
        (the first draft step then pads to at most CATCH_UP_BATCHED tokens) and the tokens fed here."""
        out, fed = [], 0
        for slot, r in zip(slots, rows):
            if len(r) > CATCH_UP_BATCHED:
                self.forward(self.drafter, self.kv.draft_pool, [slot], [r[:-1]])
                fed += len(r) - 1
                r = r[-1:]
            out.append(r)
        return out, fed

    def _native(self, pool, dv) -> bool:
        """Whether a lone row's round runs as one C++ call (``_round``): a bfloat16 drafter on the CPU with infer's
        kernels, its projections in llama.cpp's blocks without a bias (EngineConfig.draft_quantization's default over
        a quantized target), scored over a draft vocabulary whose rows are quantized too, in a paged draft pool. The
        drafter is checked once (an engine quantizes it before its first round)."""
        head = getattr(dv, "head", None)
        if not (self.native and isinstance(pool, PagedKVCachePool) and isinstance(head, BlockLinear)
                and head.bias is None and (dv.extra_weight is None or dv.extra_weight.dtype == torch.bfloat16)):
            return False
        if self._native_args is None:
            m = self.drafter
            lins = [x for layer in m.layers for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            norms = [n for layer in m.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + \
                [m.norm]
            ok = (m.device.type == "cpu" and m.dtype == torch.bfloat16 and kernels.available()
                  and all(isinstance(x, BlockLinear) and x.bias is None for x in lins)
                  and len({n.eps for n in norms}) == 1)
            self._native_args = ((tuple(x.packed for x in lins), [x.format_id for x in lins],
                                  [x.out_features for x in lins], tuple(n.weight for n in norms), norms[0].eps),) \
                if ok else ()
        return bool(self._native_args)

    def lone_round_native(self) -> bool:
        return self._native(self.kv.draft_pool, self._vocab.widened(self.draft_vocab))

    def _round(self, tokens: list[int], pool, slot: int, start: int, dv, temperature: torch.Tensor,
               u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A lone row's round in one call (kernels/lm_round.cpp): ``tokens`` at positions start .. of ``slot``
        (whose blocks and length the pool has for them and the u.shape[1] - 1 steps after them:
        PagedKVCachePool.extend), then those steps -> (drafts [1, S], q [1, S, N] over ``dv``'s columns)."""
        (packed, formats, outs, norms, eps), = self._native_args
        m, c = self.drafter, self.drafter.config
        m.rotary.reserve(start + len(tokens) + u.shape[1] - 2, m.device, m.dtype)
        return torch.ops.infer.draft_lm_round(
            torch.tensor(tokens), packed, formats, outs, norms, eps, m.embed_tokens.weight, dv.head.packed,
            dv.head.format_id, dv.extra_weight, dv.ids, m.rotary._cos, m.rotary._sin, pool.k, pool.v,
            pool.block_table(slot), pool.block_size, start, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            temperature, u)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        reqs, ks = batch.reqs, batch.ks
        B, K = len(reqs), batch.K
        pool = self.kv.draft_pool
        dslots = [self.kv.draft_slot(r) for r in reqs]
        drawer = DraftDrawer(batch, self.drafter.compute_logits, self._vocab(reqs))
        catch_up = fed = 0
        catch_up_s = 0.0
        dev = self.drafter.device
        drafting = [b for b in range(B) if ks[b] > 0]
        if len(drafting) == 1 and batch.grammar is None and not batch.keep_logits and \
                (batch.sampling is None or temperature_law_drafts(batch.sampling)) and self._native(pool, drawer.dv):
            # a lone row's whole round in one C++ call (its drafts drawn from the plain temperature law, as the
            # EAGLE heads' compiled rounds draw theirs)
            b, slot = drafting[0], dslots[drafting[0]]
            t0 = time.perf_counter()
            (rows,), fed = self._catch_up([slot], [reqs[b].token_slice(pool.seq_len(slot))])
            catch_up_s = time.perf_counter() - t0 if fed else 0.0
            start = pool.extend(slot, len(rows) + ks[b] - 1)
            temp, u = round_uniforms(batch, drafting, ks[b], dev)
            drafts, q = self._round(rows, pool, slot, start, drawer.dv, temp, u)
            drawer.put(0, drafting, drafts, q)
            return drawer.proposal(list(ks), catch_up=len(rows), catch_up_tokens=fed, catch_up_s=catch_up_s)
        for j in range(K):
            idx = [b for b in range(B) if ks[b] > j]
            if j == 0:
                t0 = time.perf_counter()
                rows, fed = self._catch_up([dslots[b] for b in idx],
                                           [reqs[b].token_slice(pool.seq_len(dslots[b])) for b in idx])
                catch_up_s = time.perf_counter() - t0 if fed else 0.0
                catch_up = max(len(r) for r in rows)
                hidden = self.forward(self.drafter, pool, [dslots[b] for b in idx], rows)
                last = hidden[torch.arange(len(idx)), torch.tensor([len(x) - 1 for x in rows])]
            else:  # one token a row, the draft before, as a tensor (no host sync inside the drafting loop)
                meta = pool.prepare([dslots[b] for b in idx], [1] * len(idx), dev)
                last = self.drafter(drawer.drafts[idx, j - 1][:, None], meta.positions, pool, meta)[:, 0]
            drawer.draw(j, idx, last)
        return drawer.proposal(list(ks), catch_up=catch_up, catch_up_tokens=fed, catch_up_s=catch_up_s)

    supports_tree = True

    @torch.inference_mode()
    def propose_tree(self, batch: DraftBatch, width: int) -> list[DraftTree]:
        reqs, pool = batch.reqs, self.kv.draft_pool
        trees = [DraftTree(r.last_token) for r in reqs]
        idx = [b for b in range(len(reqs)) if batch.ks[b] > 0]
        if not idx:
            return trees
        slots = [self.kv.draft_slot(reqs[b]) for b in idx]
        rows, _ = self._catch_up(slots, [reqs[b].token_slice(pool.seq_len(s)) for b, s in zip(idx, slots)])
        hidden = self.forward(self.drafter, pool, slots, rows)
        last = hidden[torch.arange(len(idx)), torch.tensor([len(x) - 1 for x in rows])]  # [n, H]
        dv = self._vocab(reqs)
        score = dv.logits if dv is not None else self.drafter.compute_logits
        base = [pool.seq_len(s) for s in slots]  # L: the drafter has fed the whole sequence
        depths = [batch.ks[b] for b in idx]
        feed = FrontierFeed(base, width * (max(depths) - 1), last.device)

        def step(tok, parent_slot):
            _, attn = feed.plan(tok, parent_slot)
            return top_children(score(self.forward(self.drafter, pool, slots, tok.tolist(), attn)), width, dv)

        grow([trees[b] for b in idx], top_children(score(last), width, dv), step, depths, width)
        for s, b0 in zip(slots, base):  # drop the tree's entries: the cache describes the sequence only
            pool.truncate_to(s, b0)
        return trees

    # -- profiling --------------------------------------------------------------------------------------------
    def scratch_fill(self, slots: list[int], n: int) -> None:
        self.forward(self.drafter, self.kv.draft_pool, slots, [[1] * n] * len(slots))

    def scratch_step(self, slots: list[int] | None, b: int) -> bool:
        hidden = self.forward(self.drafter, self.kv.draft_pool, slots[:b], [[1]] * b)[:, -1]
        score_synced(hidden, self.draft_vocab, self.drafter.compute_logits)
        return True

    def warm_steps(self, pool, ctx: int, widths: list[int], rows: int = 1) -> None:
        """Run on ``pool`` (a twin of the draft pool) the steps rounds run: first steps of each width (the tokens the
        drafter has not seen), then one more token (engine.warmup builds their compiled graphs), for ``rows`` rows
        at once (contexts of ctx, ctx + 1, ...: masked steps, as a served batch's), and then one of those rows alone
        (its blocks interleaved with the others')."""
        lens = [ctx + i for i in range(rows)]
        slots = [pool.allocate(n + max(widths) + 1) for n in lens]
        try:
            self.forward(self.drafter, pool, slots, [[1] * n for n in lens])
            for sub in ([slots, slots[:1]] if rows > 1 else [slots]):
                for t in widths:
                    for step in ([[1] * t], [[1]]):  # a catch-up, then a draft step; each scored as rounds do
                        hidden = self.forward(self.drafter, pool, sub, step * len(sub))[:, -1]
                        score_synced(hidden, self.draft_vocab, self.drafter.compute_logits)
                    for s, n in zip(sub, lens):
                        pool.truncate_to(s, n)
        finally:
            for s in slots:
                pool.free(s)
