"""KVManager: every KV question the scheduler asks and every KV change a step makes, for the target's pool and,
with a draft model, the drafter's pool in lockstep.

Ask, then do:  ``can_fit(decode, prefill)`` -> ``admit(req)`` / ``free(req)``; ``rollback(req, n)`` after a
speculative round. Sizing: the draft pool gets as many blocks as the target's, so the drafter has a slot and room
wherever the target does.

Prefix cache (``enable_prefix_caching``): the draft pool caches prefix blocks too, so a prompt that starts as an
earlier one did skips the drafter's catch-up over that prefix as the target skips its prefill. A draft model's entry
at position i depends on tokens 0 .. i, as the target's does; a feature head's (EAGLE) on tokens 0 .. i + 1 and on the
target's states there, so its blocks are keyed one token later (``entry_shift``). A draft block is offered once the
drafter has computed it from the request's own tokens (and, for a head, the target's true states: a prefix the
target's cache served but the draft pool's did not was fed zeros for states, and is not offered); a prompt's blocks
are offered after the round that first covers them, and every computed block, output included, when the request is
freed (the target's too: a chat's next turn, or the request itself admitted again after preemption, finds them).

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
            drafter, cfg, max_seq_len, cfg.enable_prefix_caching, num_blocks=getattr(self.pool, "num_blocks", None))
        self.lookahead = lookahead  # K_max: 0 without speculation
        self.draft_shift = getattr(drafter, "entry_shift", 0)  # 1: a feature head (the module docstring)
        self._draft_slots: dict[str, int] = {}
        self._draft_fed: dict[str, int] = {}  # a head's entries built from true states (EagleProposer)
        self._draft_offers: set[str] = set()  # requests whose draft blocks may be offered (the module docstring)
        self._draft_prompts: set[str] = set()  # ... and whose prompt's blocks have not all been offered yet
        # a feature head's proposer: feeds the entries no round fed before a freed slot's blocks are offered
        self.draft_release = None

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
        if self.draft_pool is not None:
            ids, salt = self._draft_key(prefix, req.lora_salt)
            slot = self._draft_slots[req.request_id] = self.draft_pool.allocate(req.num_tokens, ids, salt)
            hit = self._draft_fed[req.request_id] = self.draft_pool.seq_len(slot)
            if self.draft_shift and hit < req.num_computed <= hit + self.pool.block_size:
                # a head's hit ends a block short where the common prefix ends at a block's end (its last block
                # reads the next token): the target computes that block again, so the head is fed its true states
                # there, not zeros (16 tokens of prefill, against drafting worse over the whole request)
                self.pool.prefix_hits -= req.num_computed - hit
                self.pool.truncate_to(req.slot, hit)
                req.num_computed = hit
            # a head fed zeros for states the target's cache served and its own did not: none of its blocks offered
            if self.cfg.enable_prefix_caching and (not self.draft_shift or hit >= req.num_computed):
                self._draft_offers.add(req.request_id)
                self._draft_prompts.add(req.request_id)
        if req.num_cached_tokens is None:  # the prompt's hit (a preempted request's later one covers its outputs)
            req.num_cached_tokens = req.num_computed
        self.stats.prefix_cache_hit_tokens += req.num_computed

    def _draft_key(self, ids: list[int] | None, salt: int) -> tuple[list[int] | None, int]:
        """The draft pool's prefix-cache key of ``ids``: a head's block i holds entries that read tokens up to
        (i + 1) * block_size, so its chain runs over tokens 1 .. and the first token goes into the salt."""
        if not ids or not self.draft_shift:
            return ids, salt
        return ids[1:], hash((salt, ids[0]))

    def _cache_draft(self, req: Request, last: bool = False) -> None:
        """Offer the draft pool's blocks of ``req``'s prompt that hold what the drafter computed from it (module
        docstring), until the drafter covers the whole prompt; when the request is freed (``last``), its output's
        too, as the target's."""
        rid = req.request_id
        if rid not in (self._draft_offers if last else self._draft_prompts):
            return
        slot = self._draft_slots[rid]
        ids, salt = self._draft_key(req.all_ids() if last else req.prompt_ids, req.lora_salt)
        valid = self.draft_fed(req) if self.draft_shift else self.draft_pool.seq_len(slot)
        self.draft_pool.cache_prefix(slot, ids, salt, valid)
        if last:
            self._draft_offers.discard(rid)
            self._draft_prompts.discard(rid)
        elif valid >= len(ids) // self.draft_pool.block_size * self.draft_pool.block_size:
            self._draft_prompts.discard(rid)

    def draft_fed(self, req: Request) -> int:
        """A feature head's entries of ``req`` built from the target's true states (positions 0 .. n - 1): the
        prefix hit at admission, then what each round's catch-up fed (``set_draft_fed``); the slot's later entries
        came from predicted states and are rebuilt next round."""
        rid = req.request_id
        return min(self._draft_fed[rid], self.draft_pool.seq_len(self._draft_slots[rid]))

    def set_draft_fed(self, req: Request, n: int) -> None:
        self._draft_fed[req.request_id] = n

    def free(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._draft_offers and self.draft_release is not None and req.slot is not None \
                and req.num_computed >= req.num_tokens - 1:  # decoding: the target's states reach the last token
            self.draft_release(req)
        if req.slot is not None:
            # its computed blocks, output included (vLLM's): a chat's next turn starts with this one's answer, and a
            # preempted request admitted again finds its own past
            self.pool.cache_prefix(req.slot, req.all_ids(), req.lora_salt, req.num_computed)
            self.pool.free(req.slot)
            req.slot = None
        req.num_computed = 0
        slot = self._draft_slots.get(req.request_id)
        if slot is not None:
            self._cache_draft(req, last=True)
            del self._draft_slots[req.request_id], self._draft_fed[req.request_id]
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
            self._cache_draft(req)

    def cache_prefix(self, req: Request) -> None:
        self.pool.cache_prefix(req.slot, req.prompt_ids, req.lora_salt)

    def reset_prefix_cache(self) -> int:
        if self.draft_pool is not None:
            self.draft_pool.reset_prefix_cache()
        return self.pool.reset_prefix_cache()

    def free_kv_tokens(self) -> int:
        free = self.pool.free_token_capacity()
        return free if self.draft_pool is None else min(free, self.draft_pool.free_token_capacity())
