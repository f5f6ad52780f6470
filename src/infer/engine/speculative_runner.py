"""SpeculativeRunner (D1-D7): continuous batching whose decode step drafts K tokens per request and verifies them
all in one batched target forward.

Prefill is the ContinuousRunner's (target only). The drafter has its own pool of the same backend, allocated and
freed in lockstep with the target's (``_draft_slots`` maps request id -> draft slot); its prefill is lazy: each
round the drafter is first fed whatever of the sequence it has not seen (the whole prompt the first time, after a
preemption or a plain-decode step; normally just the last token, or two after a bonus).

A round for a batch of B decode requests, request b at sequence length L_b (target holds L_b - 1 tokens):

  draft    K_b drafter steps, batched (rows that are done drafting drop out):     t_b1 .. t_bK_b ~ q
  verify   one target forward over [g_b, t_b1 .. t_bK_b], padded to [B, K+1], positions L_b-1 ..  -> p [B, K+1, V]
  accept   spec.verify (pure, batched): n_b accepted + one recovered/bonus token per row
  rollback target -> L_b + n_b, drafter -> min(L_b + n_b, its length); lengths only, whole trailing pages freed
  emit     tokens one by one through Request.append: stop conditions act on accepted tokens only

K_b = min(K, max_tokens left - 1, max_seq_len - L_b) (the overflow guard); K_b = 0 rows are plain decodes inside
the same verify pass. Every emitted token is distributed exactly as the target's (Leviathan et al. 2023).
"""

from __future__ import annotations

import torch

from ..model.llama import LlamaForCausalLM
from ..request import Request, StepOutput
from ..sampling import SamplingBatch, argmax, logits_to_probs, sample, seen_mask
from ..spec.adaptive import EntropyAdaptiveGamma
from ..spec.draft_vocab import DraftVocab
from ..spec.speculative import RoundRecord
from ..spec.verify import greedy_verify, verify
from .config import EngineConfig
from .runner import ContinuousRunner, make_pool
from .stats import EngineStats


class SpeculativeRunner(ContinuousRunner):
    def __init__(self, target: LlamaForCausalLM, drafter: LlamaForCausalLM, cfg: EngineConfig, max_seq_len: int,
                 stats: EngineStats, draft_vocab: DraftVocab | None = None):
        super().__init__(target, cfg, max_seq_len, stats)
        self.drafter = drafter
        self.draft_vocab = draft_vocab  # one static subset for every row (the library loop adds the prompt's tokens)
        # same backend and the same number of blocks: the drafter needs a slot and room wherever the target does
        self.draft_pool = make_pool(drafter, cfg, max_seq_len, prefix_caching=False,
                                    num_blocks=getattr(self.pool, "num_blocks", None))
        self.K = cfg.max_draft
        self._draft_slots: dict[str, int] = {}
        self._egag: dict[str, EntropyAdaptiveGamma] = {}
        self.on_round = None  # optional callback(RoundRecord, Request), e.g. the debug view

    def speculating(self, num_decode: int) -> bool:
        limit = self.cfg.spec_max_batch_size
        return limit is None or num_decode <= limit

    def decode_tokens(self, num_decode: int) -> int:
        return num_decode * (self.K + 1 if self.speculating(num_decode) else 1)

    # -- both pools in lockstep --------------------------------------------------------------------------------
    def can_fit(self, decode: list[Request], prefill: list[tuple[Request, int]]) -> bool:
        if not self.speculating(len(decode)):
            return super().can_fit(decode, prefill) and self.draft_pool.can_fit(
                [(None, 0) for r, _ in prefill if r.slot is None])
        cap = self.max_seq_len
        target = [(r.slot, min(r.num_tokens + self.K, cap)) for r in decode]
        target += [(r.slot, r.num_computed + n) if r.slot is not None else (None, n) for r, n in prefill]
        draft = [(self._draft_slots[r.request_id], min(r.num_tokens + self.K - 1, cap)) for r in decode]
        draft += [(None, 0) for r, _ in prefill if r.slot is None]
        return self.pool.can_fit(target) and self.draft_pool.can_fit(draft)

    def admit(self, req: Request) -> None:
        super().admit(req)
        self._draft_slots[req.request_id] = self.draft_pool.allocate(req.num_tokens)
        if self.cfg.use_egag and req.request_id not in self._egag:
            self._egag[req.request_id] = EntropyAdaptiveGamma(self.cfg.gamma_min, self.cfg.egag_gamma_max,
                                                              self.cfg.egag_ema_beta)

    def free(self, req: Request) -> None:
        super().free(req)
        slot = self._draft_slots.pop(req.request_id, None)
        if slot is not None:
            self.draft_pool.free(slot)
        if req.finished:
            self._egag.pop(req.request_id, None)

    def free_kv_tokens(self) -> int:
        return min(self.pool.free_token_capacity(), self.draft_pool.free_token_capacity())

    # -- decode: draft, verify, accept, roll back, emit --------------------------------------------------------
    def decode(self, decode: list[Request]) -> list[tuple[Request, StepOutput]]:
        ks = [self._draft_len(r) for r in decode]
        if not self.speculating(len(decode)) or max(ks) == 0:
            self.stats.num_plain_decode_steps += 1
            return super().decode(decode)
        B, K, V, dev = len(decode), max(ks), self.vocab_size, self.device
        params = [r.params for r in decode]
        fast_greedy = all(p.greedy and p.repetition_penalty == 1.0 for p in params)
        batch = None if fast_greedy else SamplingBatch.from_params(params, V, dev)
        seen = seen_mask([r.all_ids() for r in decode], V, dev) if batch is not None and batch.use_penalty else None
        gens = [r.generator for r in decode]
        drafts, q, draft_logits = self._draft(decode, ks, batch, seen, gens)  # [B, K], [B, K, V] | None

        # verify: [g, t_1 .. t_k] per row in one target forward -> p_0 .. p_K
        lens = [r.num_tokens for r in decode]
        rows = [[r.last_token] + drafts[b, :ks[b]].tolist() for b, r in enumerate(decode)]
        hidden = self.forward(self.model, self.pool, [r.slot for r in decode], rows)  # [B, K+1, H]
        logits = self.model.compute_logits(hidden)  # [B, K+1, V]
        nd = torch.tensor(ks, device=dev)
        if fast_greedy:
            top = argmax(logits)  # [B, K+1]
            res = greedy_verify(drafts, top, nd)
            valid = torch.arange(K, device=dev)[None, :] < nd[:, None]
            res.expected_accept = (top[:, :K] == drafts).float().masked_fill(~valid, float("nan"))
            res.p_draft, res.q_draft = res.expected_accept, torch.ones_like(res.expected_accept)
        else:
            p_seen = None
            if seen is not None:  # position j sees the context plus t_1 .. t_j
                grow = torch.nn.functional.one_hot(drafts, V).cumsum(1).bool()  # [B, K, V]
                p_seen = torch.cat([seen[:, None], seen[:, None] | grow], 1).view(B * (K + 1), V)
            p = logits_to_probs(logits.view(B * (K + 1), V), batch.expand(K + 1), p_seen).view(B, K + 1, V)
            res = verify(drafts, q, p, gens, [pr.greedy for pr in params], nd)
        n_acc, out_tokens = res.num_accepted.tolist(), res.output_tokens.tolist()  # the round's one host sync

        outputs = []
        for b, r in enumerate(decode):
            k, n, L = ks[b], n_acc[b], lens[b]
            self.pool.truncate_to(r.slot, L + n)  # keep g and the n accepted drafts
            r.num_computed = L + n
            dslot = self._draft_slots[r.request_id]
            self.draft_pool.truncate_to(dslot, min(L + n, self.draft_pool.seq_len(dslot)))
            if k:
                r.record_round(k, n)
                self.stats.record_round(k, n)
            else:
                r.num_target_forwards += 1
            emitted = []
            for j, t in enumerate(out_tokens[b][: n + 1]):  # token j was judged by the target's p_j
                outputs.append((r, self.emit(r, t, logits[b, j])))
                emitted.append(t)
                if r.finished:
                    break
            if k and (self.on_round is not None or r.request_id in self._egag):
                self._after_round(r, k, n, emitted, drafts[b, :k].tolist(), res, b, draft_logits)
        return outputs

    def _draft_len(self, r: Request) -> int:
        egag = self._egag.get(r.request_id)
        k = egag.next_gamma() if egag is not None else self.cfg.spec_length
        left = r.params.max_tokens - len(r.output_ids)
        return max(0, min(k, left - 1, self.max_seq_len - r.num_tokens))

    def _draft(self, decode, ks, batch, seen, gens):
        """K_b drafter steps per row, batched; the first step also feeds what the drafter has not seen yet."""
        B, K, V, dev = len(decode), max(ks), self.vocab_size, self.device
        drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
        q = None if batch is None else torch.zeros(B, K, V, device=dev)
        keep_logits = self.on_round is not None or bool(self._egag)
        draft_logits = torch.zeros(B, K, V, device=dev) if keep_logits else None
        ctx_seen = None if seen is None else seen.clone()
        dslots = [self._draft_slots[r.request_id] for r in decode]
        dv = self.draft_vocab
        for j in range(K):
            idx = [b for b in range(B) if ks[b] > j]
            if j == 0:
                rows = [decode[b].token_slice(self.draft_pool.seq_len(dslots[b])) for b in idx]
            else:
                rows = [[int(t)] for t in drafts[idx, j - 1].tolist()]
            hidden = self.forward(self.drafter, self.draft_pool, [dslots[b] for b in idx], rows)
            last = hidden[torch.arange(len(idx)), torch.tensor([len(x) - 1 for x in rows])]
            rows_t = torch.tensor(idx, device=dev)
            if dv is None:
                logits = self.drafter.compute_logits(last)  # [n, V]
            else:
                sub_logits = dv.logits(last)  # [n, N]
                if batch is None and draft_logits is None:  # greedy: map the argmax within S, skip the scatter
                    drafts[rows_t, j] = dv.token(argmax(sub_logits))
                    continue
                logits = dv.expand(sub_logits)  # [n, V], -inf outside S: q(x) = 0 there
            if draft_logits is not None:
                draft_logits[rows_t, j] = logits
            if batch is None:  # greedy: argmax needs no probabilities
                drafts[rows_t, j] = argmax(logits)
                continue
            sub = batch if len(idx) == B else SamplingBatch.from_params([batch.rows[b] for b in idx], V, dev)
            probs = logits_to_probs(logits, sub, None if ctx_seen is None else ctx_seen[rows_t])
            drafts[rows_t, j] = sample(probs, [gens[b] for b in idx], [decode[b].params.greedy for b in idx])
            q[rows_t, j] = probs
            if ctx_seen is not None:
                ctx_seen[rows_t, drafts[rows_t, j]] = True
        return drafts, q, draft_logits

    def _after_round(self, r, k, n, emitted, drafted, res, b, draft_logits) -> None:
        egag = self._egag.get(r.request_id)
        h = egag.observe(draft_logits[b, :k]) if egag is not None else None
        if self.on_round is not None:
            rec = RoundRecord(k, drafted, n, emitted, bool(res.is_bonus[b]), res.expected_accept[b, :k].tolist())
            if n < k:
                rec.p_rejected, rec.q_rejected = float(res.p_draft[b, n]), float(res.q_draft[b, n])
            rec.h_norm = h
            self.on_round(rec, r)

