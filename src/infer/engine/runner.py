"""ContinuousRunner: the model side of continuous batching (no speculation).

One ``step(prefill, decode)`` runs at most two forwards: every prefill chunk in one padded batch, every decode
request (one unfed token each, at its own position) in another. A request whose chunk completes its sequence,
and every decode request, gets one token sampled from the target through the shared sampling pipeline.

Cache invariant for a request: the target's cache holds ``all_ids()[:num_computed]``. Prefilling means
``num_computed < num_tokens - 1``; decoding means exactly the last token is unfed.
"""

from __future__ import annotations

import math

import torch

from ..cache import KVCachePool, PagedKVCachePool, SlottedKVCache
from ..model.llama import LlamaForCausalLM
from ..request import Request, StepOutput
from ..sampling import SamplingBatch, argmax, logits_to_probs, sample, seen_mask
from .config import EngineConfig
from .stats import EngineStats


def make_pool(model: LlamaForCausalLM, cfg: EngineConfig, max_seq_len: int, prefix_caching: bool,
              num_blocks: int | None = None) -> KVCachePool:
    if cfg.kv_cache_backend == "contiguous":
        return SlottedKVCache.for_model(model, max_seq_len, cfg.max_batch_size)
    num_blocks = num_blocks or num_kv_blocks(model, cfg, max_seq_len)
    return PagedKVCachePool.for_model(model, num_blocks, cfg.block_size, max_seq_len, cfg.max_batch_size,
                                      prefix_caching)


def num_kv_blocks(model: LlamaForCausalLM, cfg: EngineConfig, max_seq_len: int) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_memory_mb is not None:
        c = model.config
        bytes_per_block = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * cfg.block_size * (
            torch.finfo(model.dtype).bits // 8)
        return max(1, int(cfg.kv_cache_memory_mb * 2**20 // bytes_per_block))
    return cfg.max_batch_size * math.ceil(max_seq_len / cfg.block_size)  # every slot can reach max_seq_len


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under the target's raw next-token distribution (softmax of its logits, before temperature and
    truncation, as vLLM reports by default) and the ``top`` most likely alternatives."""
    logp = logits.float().log_softmax(-1)
    alts = []
    if top:
        vals, idx = logp.topk(top)
        alts = list(zip(idx.tolist(), vals.tolist()))
    return float(logp[token]), alts


class ContinuousRunner:

    def __init__(self, model: LlamaForCausalLM, cfg: EngineConfig, max_seq_len: int, stats: EngineStats):
        self.model, self.cfg, self.max_seq_len, self.stats = model, cfg, max_seq_len, stats
        self.device, self.vocab_size = model.device, model.config.vocab_size
        self.pool = make_pool(model, cfg, max_seq_len, cfg.enable_prefix_caching)

    def decode_tokens(self, num_decode: int) -> int:
        """Tokens a decode batch of this size costs the step's token budget."""
        return num_decode

    # -- KV bookkeeping (ask, then do) -------------------------------------------------------------------------
    def can_fit(self, decode: list[Request], prefill: list[tuple[Request, int]]) -> bool:
        demands = [(r.slot, r.num_tokens) for r in decode]
        demands += [(r.slot, r.num_computed + n) if r.slot is not None else (None, n) for r, n in prefill]
        return self.pool.can_fit(demands)

    def admit(self, req: Request) -> None:
        req.slot = self.pool.allocate(req.num_tokens, prefix_ids=req.all_ids())
        req.num_computed = self.pool.seq_len(req.slot)  # prefix-cache hit
        self.stats.prefix_cache_hit_tokens += req.num_computed

    def free(self, req: Request) -> None:
        if req.slot is not None:
            self.pool.free(req.slot)
            req.slot = None
        req.num_computed = 0

    def free_kv_tokens(self) -> int:
        return self.pool.free_token_capacity()

    # -- forward helpers ---------------------------------------------------------------------------------------
    def forward(self, model: LlamaForCausalLM, pool: KVCachePool, slots: list[int], rows: list[list[int]]):
        """Append ``rows[i]`` to ``slots[i]`` in one padded forward -> hidden [B, T, H]."""
        T = max(len(r) for r in rows)
        x = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r)] = torch.as_tensor(r)
        meta = pool.prepare(slots, [len(r) for r in rows], self.device)
        return model(x.to(self.device), meta.positions, pool, meta)

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """logits [N, V] of each request's next token -> one token each (the pipeline of sampling.py)."""
        params = [r.params for r in reqs]
        if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            return argmax(logits).tolist()
        batch = SamplingBatch.from_params(params, self.vocab_size, self.device)
        seen = seen_mask([r.all_ids() for r in reqs], self.vocab_size, self.device) if batch.use_penalty else None
        probs = logits_to_probs(logits, batch, seen)
        return sample(probs, [r.generator for r in reqs], [p.greedy for p in params]).tolist()

    def emit(self, req: Request, token: int, logits: torch.Tensor | None = None) -> StepOutput:
        """Append one token to the request (stop conditions live in Request.append) -> its StepOutput.

        ``logits`` [V]: the target's logits for this position, for requests that asked for logprobs.
        """
        done = req.append(token)  # stamps first_token_time
        self.stats.generation_tokens += 1
        out = StepOutput(req.request_id, token, req.stream_text(), done, req.finish_reason)
        if req.params.logprobs is not None and logits is not None:
            out.logprob, out.top_logprobs = token_logprobs(logits, token, req.params.logprobs)
        if done and req.num_draft_tokens:
            out.acceptance_rate = req.acceptance_rate
            out.num_draft_tokens, out.num_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
        return out

    # -- step --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, prefill: list[tuple[Request, int]], decode: list[Request]) -> list[tuple[Request, StepOutput]]:
        outputs = self.prefill(prefill)
        if decode:
            outputs += self.decode(decode)
        return outputs

    def prefill(self, prefill: list[tuple[Request, int]]) -> list[tuple[Request, StepOutput]]:
        """Feed each request's next chunk; sample for the requests whose chunk reaches the end of the sequence."""
        if not prefill:
            return []
        rows = [r.token_slice(r.num_computed, r.num_computed + n) for r, n in prefill]
        hidden = self.forward(self.model, self.pool, [r.slot for r, _ in prefill], rows)
        done_idx, done_reqs = [], []
        for i, (r, n) in enumerate(prefill):
            r.num_computed += n
            self.stats.prompt_tokens += n
            self.pool.cache_prefix(r.slot, r.prompt_ids)
            if r.num_computed == r.num_tokens:
                r.num_target_forwards += 1
                done_idx.append((i, n - 1))
                done_reqs.append(r)
        if not done_reqs:
            return []
        last = torch.stack([hidden[i, j] for i, j in done_idx])
        logits = self.model.compute_logits(last)
        tokens = self.sample(done_reqs, logits)
        return [(r, self.emit(r, t, logits[i])) for i, (r, t) in enumerate(zip(done_reqs, tokens))]

    def decode(self, decode: list[Request]) -> list[tuple[Request, StepOutput]]:
        """One token for each request: feed its unfed last token at its own position."""
        hidden = self.forward(self.model, self.pool, [r.slot for r in decode], [[r.last_token] for r in decode])
        logits = self.model.compute_logits(hidden[:, -1])
        tokens = self.sample(decode, logits)
        outs = []
        for i, (r, t) in enumerate(zip(decode, tokens)):
            r.num_computed += 1
            r.num_target_forwards += 1
            outs.append((r, self.emit(r, t, logits[i])))
        return outs
