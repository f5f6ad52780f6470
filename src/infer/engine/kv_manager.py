"""KVManager: every KV question the scheduler asks and every KV change a step makes, for the target's pool and,
with a draft model, the drafter's pool in lockstep.

Ask, then do:  ``can_fit(decode, prefill)`` -> ``admit(req)`` / ``free(req)``; ``rollback(req, n)`` after a
speculative round. Sizing: the draft pool gets as many blocks as the target's, so the drafter has a slot and room
wherever the target does.

Lookahead: a speculative round appends up to K_max drafts after a decode request's last token before rejection
rolls them back, so a decode request needs room for ``num_tokens + K_max`` positions in the target (the drafter
writes one fewer: it never consumes its own last draft). Decode batches larger than ``spec_max_batch_size`` never
speculate and reserve nothing.
"""

from __future__ import annotations

import math

import torch

from ..cache import KVCachePool, PagedKVCachePool, SlottedKVCache
from ..model.llama import LlamaForCausalLM
from ..request import Request
from .config import EngineConfig


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


class KVManager:
    def __init__(self, target: LlamaForCausalLM, cfg: EngineConfig, max_seq_len: int, stats,
                 drafter: LlamaForCausalLM | None = None, lookahead: int = 0):
        self.cfg, self.max_seq_len, self.stats = cfg, max_seq_len, stats
        self.pool = make_pool(target, cfg, max_seq_len, cfg.enable_prefix_caching)
        self.draft_pool = None if drafter is None else make_pool(
            drafter, cfg, max_seq_len, prefix_caching=False, num_blocks=getattr(self.pool, "num_blocks", None))
        self.lookahead = lookahead  # K_max: 0 without speculation
        self._draft_slots: dict[str, int] = {}

    def speculating(self, num_decode: int) -> bool:
        limit = self.cfg.spec_max_batch_size
        return self.lookahead > 0 and (limit is None or num_decode <= limit)

    def decode_tokens(self, num_decode: int) -> int:
        """Tokens a decode batch of this size costs the step's token budget: one a request, speculating or not.

        The budget paces prefill against decoding; it is not a KV question (``can_fit`` reserves the lookahead).
        Charging K_max + 1 a speculating row shrank every prefill chunk while rows decode, whatever K the round then
        chose (often 0 under load): the demo pair at concurrency 8 admitted its prompts more slowly than plain
        decoding and lost ~5% of wall clock to it. A round's K extra tokens a row are priced by auto K instead."""
        return num_decode

    def can_fit(self, decode: list[Request], prefill: list[tuple[Request, int]]) -> bool:
        ahead = self.lookahead if self.speculating(len(decode)) else 0
        cap = self.max_seq_len
        target = [(r.slot, min(r.num_tokens + ahead, cap)) for r in decode]
        target += [(r.slot, r.num_computed + n) if r.slot is not None else (None, n) for r, n in prefill]
        if not self.pool.can_fit(target):
            return False
        if self.draft_pool is None:
            return True
        new = [(None, 0) for r, _ in prefill if r.slot is None]
        if not ahead:
            return self.draft_pool.can_fit(new)
        draft = [(self._draft_slots[r.request_id], min(r.num_tokens + ahead - 1, cap)) for r in decode]
        return self.draft_pool.can_fit(draft + new)

    def admit(self, req: Request) -> None:
        # a prompt whose logprobs were asked for is computed whole: a cached prefix holds no states to score it by
        prefix = req.all_ids() if req.prompt_logprobs is None else None
        # a prefix's K/V depends on the adapter that computed it: each adapter's prompts share only among themselves
        req.slot = self.pool.allocate(req.num_tokens, prefix_ids=prefix, salt=req.lora_salt)
        req.num_computed = self.pool.seq_len(req.slot)  # prefix-cache hit
        if req.num_cached_tokens is None:  # the prompt's hit (a preempted request's later one covers its outputs)
            req.num_cached_tokens = req.num_computed
        self.stats.prefix_cache_hit_tokens += req.num_computed
        if self.draft_pool is not None:
            self._draft_slots[req.request_id] = self.draft_pool.allocate(req.num_tokens)

    def free(self, req: Request) -> None:
        if req.slot is not None:
            self.pool.free(req.slot)
            req.slot = None
        req.num_computed = 0
        slot = self._draft_slots.pop(req.request_id, None)
        if slot is not None:
            self.draft_pool.free(slot)

    def draft_slot(self, req: Request) -> int:
        return self._draft_slots[req.request_id]

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions: the target's cache holds exactly those afterwards, the drafter's
        at most those (it may lag behind and catches up lazily). Lengths only, whole trailing pages freed."""
        self.pool.truncate_to(req.slot, num_tokens)
        req.num_computed = num_tokens
        if self.draft_pool is not None:
            slot = self._draft_slots[req.request_id]
            self.draft_pool.truncate_to(slot, min(num_tokens, self.draft_pool.seq_len(slot)))

    def cache_prefix(self, req: Request) -> None:
        self.pool.cache_prefix(req.slot, req.prompt_ids, req.lora_salt)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def free_kv_tokens(self) -> int:
        free = self.pool.free_token_capacity()
        return free if self.draft_pool is None else min(free, self.draft_pool.free_token_capacity())
