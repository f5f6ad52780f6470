"""DraftModelProposer: a small model of the same vocabulary drafts K tokens per row, batched.

Its KV lives in the KV manager's draft pool, allocated, rolled back and freed in lockstep with the target's. Its
prefill is lazy: a row's first draft step feeds whatever of the sequence the drafter has not seen (the whole prompt
the first time, after a preemption, after rounds drafted by another proposer; normally just the last token, or two
after a bonus). Rows that have drafted their K drop out of later steps.

With a draft vocabulary (spec_decode.draft_vocab) the drafter scores only a subset S of tokens, united with the
prompts' own tokens (code copies identifiers from its context): q(x) = 0 outside S, which stays lossless.
"""

from __future__ import annotations

import time
import weakref

import torch

from ..model.llama import LlamaForCausalLM
from ..sampling import SamplingBatch, argmax, logits_to_probs, sample
from .draft_vocab import DraftVocab
from .proposer import DraftBatch, Proposal, Proposer

# Most tokens a row brings to the batched first draft step: usually 1 or 2 (after a bonus the drafter never saw the
# last draft), a few after rounds at K = 0. A longer catch-up (a prompt) is fed alone first: padding every row of the
# batch to its length would cost B prompts, one more forward costs ~one draft step.
CATCH_UP_BATCHED = 16


class DraftModelProposer(Proposer):
    name = "draft"
    uses_draft_model = True

    def __init__(self, drafter: LlamaForCausalLM, kv, forward, draft_vocab: DraftVocab | None = None):
        """``kv``: the KV manager (draft pool and slots); ``forward(model, pool, slots, rows)`` -> hidden [B, T, H]."""
        self.drafter, self.kv, self.forward, self.draft_vocab = drafter, kv, forward, draft_vocab
        self._vocab_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Request -> its S + prompt
        self._batch_vocab: tuple[tuple[int, ...], DraftVocab] | None = None  # last batch's union, reused

    def _vocab(self, reqs) -> DraftVocab | None:
        """S united with every row's prompt tokens (one subset per batch: one GEMV for all rows)."""
        if self.draft_vocab is None:
            return None
        key = tuple(r.request_id for r in reqs)
        if self._batch_vocab is None or self._batch_vocab[0] != key:
            for r in reqs:
                if r not in self._vocab_of:
                    self._vocab_of[r] = self.draft_vocab.including(r.prompt_ids)
            vocab = self._vocab_of[reqs[0]]
            for r in reqs[1:]:
                vocab = vocab.including(self._vocab_of[r].id_list)
            self._batch_vocab = (key, vocab)
        return self._batch_vocab[1]

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

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        reqs, ks, sampling = batch.reqs, batch.ks, batch.sampling
        B, K, V, dev = len(reqs), batch.K, batch.vocab_size, batch.device
        drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
        q = None if sampling is None else torch.zeros(B, K, V, device=dev)
        logits_out = torch.zeros(B, K, V, device=dev) if batch.keep_logits else None
        ctx_seen = None if batch.seen is None else batch.seen.clone()
        pool = self.kv.draft_pool
        dslots = [self.kv.draft_slot(r) for r in reqs]
        dv = self._vocab(reqs)
        catch_up = fed = 0
        catch_up_s = 0.0
        for j in range(K):
            idx = [b for b in range(B) if ks[b] > j]
            if j == 0:
                t0 = time.perf_counter()
                rows, fed = self._catch_up([dslots[b] for b in idx],
                                           [reqs[b].token_slice(pool.seq_len(dslots[b])) for b in idx])
                catch_up_s = time.perf_counter() - t0 if fed else 0.0
                catch_up = max(len(r) for r in rows)
            else:
                rows = [[int(t)] for t in drafts[idx, j - 1].tolist()]
            hidden = self.forward(self.drafter, pool, [dslots[b] for b in idx], rows)
            last = hidden[torch.arange(len(idx)), torch.tensor([len(x) - 1 for x in rows])]
            rows_t = torch.tensor(idx, device=dev)
            if dv is None:
                logits = self.drafter.compute_logits(last)  # [n, V]
            else:
                sub_logits = dv.logits(last)  # [n, N]
                if sampling is None and logits_out is None:  # greedy: map the argmax within S, skip the scatter
                    drafts[rows_t, j] = dv.token(argmax(sub_logits))
                    continue
                logits = dv.expand(sub_logits)  # [n, V], -inf outside S: q(x) = 0 there
            if logits_out is not None:
                logits_out[rows_t, j] = logits
            if sampling is None:  # greedy: argmax needs no probabilities
                drafts[rows_t, j] = argmax(logits)
                continue
            sub = sampling if len(idx) == B else SamplingBatch.from_params([sampling.rows[b] for b in idx], V, dev)
            probs = logits_to_probs(logits, sub, None if ctx_seen is None else ctx_seen[rows_t])
            drafts[rows_t, j] = sample(probs, [batch.generators[b] for b in idx], [reqs[b].params.greedy for b in idx])
            q[rows_t, j] = probs
            if ctx_seen is not None:  # the penalty context of draft j+1 includes draft j
                ctx_seen[rows_t, drafts[rows_t, j]] = True
        return Proposal(drafts, list(ks), q, logits_out, catch_up, fed, catch_up_s)
