"""ModelRunner: executes the models for continuous batching; the KV manager owns the caches' bookkeeping.

``prefill(chunks)`` feeds every prefill chunk in one padded batch; ``decode(reqs)`` feeds every decode request's
one unfed token, at its own position, in another (a speculative round replaces it: spec_decode.round). A request
whose chunk completes its sequence, and every decode request, gets one token sampled from the target through the
shared sampling pipeline; ``emit`` appends it (stop conditions live in Request.append).

Cache invariant for a request: the target's cache holds ``all_ids()[:num_computed]``. Prefilling means
``num_computed < num_tokens - 1``; decoding means exactly the last token is unfed.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..cache import KVCachePool
from ..cache.base import TreeAttn
from ..model.llama import LlamaForCausalLM
from ..request import Request, StepOutput
from ..structured import mask_rows_
from ..sampling import SamplingBatch, argmax, ban_early_stops_, logits_to_probs, request_contexts, sample
from ..logits_processors import apply_logits_processors_
from ..token_bans import ban_bad_words_
from .kv_manager import KVManager
from .stats import EngineStats


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under the target's raw next-token distribution (softmax of its logits, before temperature and
    truncation, as vLLM reports by default) and the ``top`` most likely alternatives."""
    logp = logits.float().log_softmax(-1)
    alts = []
    if top:
        vals, idx = logp.topk(top)
        # a structured-output mask may leave fewer than ``top`` tokens possible: the impossible ones are not listed
        alts = [(i, v) for i, v in zip(idx.tolist(), vals.tolist()) if v != float("-inf")]
    return float(logp[token]), alts


class ModelRunner:

    def __init__(self, model: LlamaForCausalLM, kv: KVManager, stats: EngineStats):
        self.model, self.kv, self.stats = model, kv, stats
        self.device, self.vocab_size = model.device, model.config.vocab_size
        # (req, first position, hidden [n, H]) for every position the target computes, when a proposer drafts from
        # the target's hidden states (EAGLE, Medusa); a verify pass hands over its accepted positions only
        self.feature_sink = None

    # -- forward helpers ---------------------------------------------------------------------------------------
    def forward(self, model: LlamaForCausalLM, pool: KVCachePool, slots: list[int], rows: list[list[int]],
                tree: TreeAttn | None = None, reqs: list[Request] | None = None):
        """Append ``rows[i]`` to ``slots[i]`` in one padded forward -> hidden [B, T, H] (``tree``: the rows are token
        trees, cache.base.TreeAttn). ``reqs``: the rows' requests, whose LoRA adapters the target applies (where it
        carries per-request ones: Request.lora)."""
        adapters = [r.lora for r in reqs] if reqs is not None and model is self.model and any(r.lora for r in reqs) \
            else None
        if len(rows) == 1 and len(rows[0]) <= kernels.MAX_ROWS and tree is None \
                and isinstance(model, LlamaForCausalLM) and model.runs_natively(pool):
            # a lone row's decode or verify: one C++ call
            return model.native_step(rows[0], pool, slots[0], adapters[0] if adapters else 0)
        T = max(len(r) for r in rows)
        x = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r)] = torch.as_tensor(r)
        meta = pool.prepare(slots, [len(r) for r in rows], self.device, tree)
        if adapters is not None:
            meta.adapters = torch.tensor(adapters, device=self.device)
        return model(x.to(self.device), meta.positions, pool, meta)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """logits [N, V] of each request's next token -> one token each (the pipeline of sampling.py). A request
        with structured output has its disallowed tokens set to -inf in ``logits`` first (in place: the logprobs
        reported are then those of the law sampled)."""
        if any(r.params.logits_processors for r in reqs):  # the request's own functions, before every rule
            apply_logits_processors_(logits, reqs)
        if any(r.params.min_tokens for r in reqs):  # no stop token before the request's min_tokens
            ban_early_stops_(logits, reqs)
        if any(r.bad_words for r in reqs):  # no bad word completed
            ban_bad_words_(logits, reqs)
        if any(r.grammar is not None for r in reqs):
            mask_rows_(logits, [r.grammar for r in reqs])
        params = [r.params for r in reqs]
        if all(p.greedy and not p.reshapes_logits for p in params):
            return argmax(logits).tolist()
        batch = SamplingBatch.from_params(params, self.vocab_size, self.device)
        ctx = request_contexts(reqs, self.vocab_size, self.device) if batch.use_penalty else None
        probs = logits_to_probs(logits, batch, ctx)
        return sample(probs, [r.generator for r in reqs], [p.greedy for p in params]).tolist()

    def emit(self, req: Request, token: int, logits: torch.Tensor | None = None, source: str = "target",
             round_k: int = 0) -> StepOutput:
        """Append one token to the request (stop conditions live in Request.append) -> its StepOutput.

        ``logits`` [V]: the target's logits for this position, for requests that asked for logprobs; ``source`` and
        ``round_k``: how a speculative round produced it (StepOutput).
        """
        done = req.append(token)  # stamps first_token_time
        self.stats.generation_tokens += 1
        out = StepOutput(req.request_id, token, req.stream_text(), done, req.finish_reason, source=source,
                         round_k=round_k)
        if req.params.logprobs is not None and logits is not None:
            out.logprob, out.top_logprobs = token_logprobs(logits, token, req.params.logprobs)
            req.logprobs.append((out.logprob, out.top_logprobs))
        if req.prompt_logprobs is not None and len(req.output_ids) == 1:
            out.prompt_logprobs = list(req.prompt_logprobs)
        if done:
            out.num_cached_tokens, out.stop_reason = req.num_cached_tokens or 0, req.stop_reason
        if done and req.num_draft_tokens:
            out.acceptance_rate = req.acceptance_rate
            out.num_draft_tokens, out.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
        return out

    # -- the two plain steps -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prefill: list[tuple[Request, int]]) -> list[tuple[Request, StepOutput]]:
        """Feed each request's next chunk; sample for the requests whose chunk reaches the end of the sequence."""
        if not prefill:
            return []
        # One forward a request: a prompt's states must not depend on which prompts share its step. Beside a longer
        # neighbour a row is padded and ATen's attention takes its masked path, an ulp away from the causal one, and
        # with a quantized target (int8 activations) an ulp can flip a rounding that 30 layers carry to a near-tie
        # (docs/design.md, numerics): plain and speculating engines, whose requests finish at other steps, would
        # then prefill the same prompt with other neighbours and part.
        hidden = [self.forward(self.model, self.kv.pool, [r.slot],
                               [r.token_slice(r.num_computed, r.num_computed + n)], reqs=[r])[0]
                  for r, n in prefill]  # [n, H] each
        done_idx, done_reqs = [], []
        for i, (r, n) in enumerate(prefill):
            if self.feature_sink is not None:
                self.feature_sink(r, r.num_computed, hidden[i][:n])
            if r.prompt_logprobs is not None:
                self._prompt_logprobs(r, r.num_computed, hidden[i][:n])
            r.num_computed += n
            if r.num_computed == r.num_tokens - 1:  # a chunk that ends a token short (where a chunk ends depends on
                r.plain_next = True  # the cache's hit): the next token drawn as a prefill's (Request.plain_next)
            self.stats.prompt_tokens += n
            self.kv.cache_prefix(r)
            if r.num_computed == r.num_tokens:
                r.num_target_forwards += 1
                done_idx.append((i, n - 1))
                done_reqs.append(r)
        if not done_reqs:
            return []
        last = torch.stack([hidden[i][j] for i, j in done_idx])
        logits = self.model.compute_logits(last[:, None])[:, 0]  # [n, 1, H]: the per-row kernels at any n
        tokens = self.sample(done_reqs, logits)
        return [(r, self.emit(r, t, logits[i])) for i, (r, t) in enumerate(zip(done_reqs, tokens))]

    def _prompt_logprobs(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """A chunk's states at positions start .. start + n - 1 (hidden [n, H]) -> (log p, top alternatives, rank) of
        prompt tokens start + 1 .. (those the chunk predicts; the prompt's last position predicts the first output,
        which ``emit`` reports)."""
        m = min(hidden.shape[0], len(req.prompt_ids) - 1 - start)
        if m <= 0:
            return
        top = req.params.prompt_logprobs
        logp = self.model.compute_logits(hidden[None, :m])[0].float().log_softmax(-1)  # [m, V]
        nxt = torch.tensor(req.prompt_ids[start + 1:start + 1 + m], device=logp.device)
        own_t = logp.gather(1, nxt[:, None])  # [m, 1]
        # vLLM's rank: 1 + how many tokens the target finds likelier than the prompt's own
        ranks = ((logp > own_t).sum(-1) + 1).tolist()
        own = own_t[:, 0].tolist()
        if top:
            vals, idx = logp.topk(top, -1)
            alts = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            alts = [[] for _ in range(m)]
        req.prompt_logprobs[start + 1:start + 1 + m] = list(zip(own, alts, ranks))

    @torch.inference_mode()
    def decode(self, decode: list[Request]) -> list[tuple[Request, StepOutput]]:
        """One token for each request: feed its unfed last token at its own position."""
        tokens, logits = self.decode_forward(decode)
        return self.emit_decoded(decode, tokens, logits)

    def decode_forward(self, decode: list[Request]) -> tuple[list[int], torch.Tensor]:
        """The forward and sampling half of a decode step -> (one token per request, logits [B, V])."""
        hidden = self.forward(self.model, self.kv.pool, [r.slot for r in decode], [[r.last_token] for r in decode],
                              reqs=decode)
        if self.feature_sink is not None:
            for i, r in enumerate(decode):
                self.feature_sink(r, r.num_computed, hidden[i, :1])
        # [B, 1, H], not [B, H]: a verify's [B, K+1, H] takes the per-row kernels at any B, and so must a decode
        logits = self.model.compute_logits(hidden[:, -1:])[:, 0]
        return self.sample(decode, logits), logits

    def emit_decoded(self, decode: list[Request], tokens: list[int], logits) -> list[tuple[Request, StepOutput]]:
        outs = []
        for i, (r, t) in enumerate(zip(decode, tokens)):
            r.num_computed += 1
            r.num_target_forwards += 1
            outs.append((r, self.emit(r, t, logits[i])))
        return outs
