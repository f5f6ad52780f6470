"""Paged KV storage: fixed-size blocks from one free list, a block table per sequence, a refcounted prefix cache.

Storage is token-addressed: ``k[layer]`` is ``[num_blocks * block_size + 1, Hkv, D]`` and position p of a slot
lives at row ``table[p // block_size] * block_size + p % block_size``. The last row is the scratch sink for padded
query rows. A forward gathers each row's keys through ``read_pos [B, kv_len]`` (entries past a row's length point
at any valid row; the mask hides them) and scatters the new K/V through ``write_pos [B, T]``.

Prefix cache (``enable_prefix_caching``): as a prompt's prefill advances, and when a request is freed (its output's
blocks too), each *full* block of computed tokens is registered under a hash chaining all tokens up to its end, so
equal hashes mean equal prefixes. A later prompt
with the same leading blocks takes them (refcount + 1) instead of recomputing. A block whose refcount drops to 0
stays cached but *evictable* (LRU); the free list is used first, then the oldest evictable block is recycled.

Invariants: a block is in exactly one of {free list, evictable set, referenced by >= 1 slot}; cached blocks are
only ever read (slots write strictly after their hit length, and only full blocks of computed tokens are cached);
``truncate_to`` drops references to whole trailing blocks and copies nothing.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import torch

from .base import AttnMeta, KVCachePool, TreeAttn, build_positions, kv_storage, tree_plan


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _consecutive(table: list[int]) -> bool:
    """Whether a row's blocks (a non-empty table) are consecutive in storage: its keys are then one slice."""
    return table[-1] - table[0] == len(table) - 1 and table == list(range(table[0], table[0] + len(table)))


class PagedKVCachePool(KVCachePool):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        max_seq_len: int = 4096,
        max_slots: int = 8,
        enable_prefix_caching: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        lazy: bool = False,  # storage left unzeroed and uncommitted (KVCachePool.twin): results are thrown away
    ):
        if num_blocks <= 0 or block_size <= 0 or max_seq_len <= 0 or max_slots <= 0:
            raise ValueError(f"num_blocks, block_size, max_seq_len and max_slots must be > 0, got "
                             f"{num_blocks}, {block_size}, {max_seq_len}, {max_slots}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.max_seq_len, self.max_slots = max_seq_len, max_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.device = torch.device(device)
        self.scratch = num_blocks * block_size
        shape = (num_blocks * block_size + 1, num_kv_heads, head_dim)
        # zeros (kv_storage says why, and why they cost nothing until written)
        # One tensor per layer (not views of one): compiled, writes into a tensor of its own stay in place.
        self.k = [kv_storage(shape, dtype, self.device, lazy) for _ in range(num_layers)]
        self.v = [kv_storage(shape, dtype, self.device, lazy) for _ in range(num_layers)]
        # a min-heap: the lowest free block goes first, so a sequence alone in the pool (or one that grows after
        # others left) gets consecutive blocks, which attention reads as a plain slice instead of a gather
        self._free_blocks = list(range(num_blocks))
        self._ref = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, LRU first
        self._hash_of: dict[int, int] = {}  # block -> prefix hash (cached blocks only)
        self._block_of: dict[int, int] = {}  # prefix hash -> block
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self.prefix_hits = 0  # tokens served from the prefix cache (lifetime counter)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int, max_seq_len: int, max_slots: int,
                  enable_prefix_caching: bool = False, lazy: bool = False) -> PagedKVCachePool:
        cfg, p = model.config, next(model.parameters())
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks, block_size,
                   max_seq_len, max_slots, enable_prefix_caching, dtype=p.dtype, device=p.device, lazy=lazy)

    # -- blocks ------------------------------------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free_blocks:
            b = heapq.heappop(self._free_blocks)
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)  # least recently released cached block
            del self._block_of[self._hash_of.pop(b)]
        else:
            raise RuntimeError("KV pool exhausted: no free block (the scheduler should have asked can_fit)")
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if b in self._hash_of:
                self._evictable[b] = None  # keep the cached K/V until the space is needed
            else:
                heapq.heappush(self._free_blocks, b)

    def _prefix_hashes(self, token_ids: list[int], n_blocks: int, salt: int = 0) -> list[int]:
        hashes, h, bs = [], salt, self.block_size
        for i in range(n_blocks):
            h = hash((h, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(h)
        return hashes

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks) + len(self._evictable)

    def blocks_needed(self, slot: int | None, new_len: int) -> int:
        have = len(self._tables[slot]) if slot is not None else 0
        return max(0, _cdiv(new_len, self.block_size) - have)

    # -- KVCachePool -------------------------------------------------------------------------------------------
    def allocate(self, num_tokens: int = 0, prefix_ids: list[int] | None = None, salt: int = 0) -> int:
        if num_tokens > self.max_seq_len:
            raise ValueError(f"{num_tokens} tokens exceed the cache's max_seq_len {self.max_seq_len}")
        if not self._free_slots:
            raise RuntimeError(f"no free KV slot (all {self.max_slots} in use)")
        slot = self._free_slots.pop()
        table: list[int] = []
        if self.enable_prefix_caching and prefix_ids:
            # never the whole prompt: its last token must run through the model to produce logits
            for h in self._prefix_hashes(prefix_ids, (len(prefix_ids) - 1) // self.block_size, salt):
                b = self._block_of.get(h)
                if b is None:
                    break
                if self._ref[b] == 0:
                    del self._evictable[b]
                self._ref[b] += 1
                table.append(b)
        self._tables[slot] = table
        self._lens[slot] = len(table) * self.block_size
        self.prefix_hits += self._lens[slot]
        return slot

    def cache_prefix(self, slot: int, token_ids: list[int], salt: int = 0, num_valid: int | None = None) -> None:
        if not self.enable_prefix_caching:
            return
        n = min(len(token_ids), self._lens[slot] if num_valid is None else min(self._lens[slot], num_valid))
        table, n_full = self._tables[slot], n // self.block_size
        for i, h in enumerate(self._prefix_hashes(token_ids, n_full, salt)):
            b = table[i]
            if h not in self._block_of and b not in self._hash_of:
                self._block_of[h], self._hash_of[b] = b, h

    def reset_prefix_cache(self) -> int:
        # Metadata only: a cached block referenced by a slot stays that slot's (returned to the free list when it
        # is released, being uncached now); an evictable one is free at once. No K/V is copied or cleared.
        n = len(self._block_of)
        for b in self._evictable:
            heapq.heappush(self._free_blocks, b)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        return n

    def free(self, slot: int) -> None:
        if slot not in self._tables:
            raise ValueError(f"slot {slot} is not allocated")
        for b in reversed(self._tables.pop(slot)):  # tail blocks first: they become the first evicted
            self._release(b)
        del self._lens[slot]
        self._free_slots.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._lens[slot]

    def truncate_to(self, slot: int, new_len: int) -> None:
        self._check_truncate(slot, new_len)
        self._lens[slot] = new_len
        table = self._tables[slot]
        keep = _cdiv(new_len, self.block_size)  # a partial last block stays; its stale tail is overwritten later
        while len(table) > keep:
            self._release(table.pop())

    def can_fit(self, demands: list[tuple[int | None, int]]) -> bool:
        new = sum(1 for slot, _ in demands if slot is None)
        if new > len(self._free_slots) or any(n > self.max_seq_len for _, n in demands):
            return False
        return sum(self.blocks_needed(s, n) for s, n in demands) <= self.num_free_blocks

    def free_token_capacity(self) -> int:
        return self.num_free_blocks * self.block_size

    @property
    def num_used_slots(self) -> int:
        return len(self._tables)

    def _rows(self, slot: int, positions: list[int]) -> list[int]:
        table, bs = self._tables[slot], self.block_size
        return [table[p // bs] * bs + p % bs for p in positions]

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        if src:
            self._replay("_move_rows", self._rows(slot, src), self._rows(slot, dst))

    def _move_rows(self, src: list[int], dst: list[int]) -> None:
        si = torch.tensor(src, dtype=torch.long, device=self.device)
        di = torch.tensor(dst, dtype=torch.long, device=self.device)
        for kc, vc in zip(self.k, self.v):  # advanced indexing reads into a new tensor first: overlaps are safe
            kc[di], vc[di] = kc[si], vc[si]

    def layout(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "max_seq_len": self.max_seq_len,
                "max_slots": self.max_slots}

    def prepare(self, slots: list[int], num_new: list[int], device=None, tree: TreeAttn | None = None) -> AttnMeta:
        device = device or self.device
        bs = self.block_size
        start = self._reserve(slots, num_new)
        positions, mask, kv_len, is_causal = build_positions(start, num_new, device)
        write_pos = positions  # one row: the positions written (update() adds the first block's storage row)
        if tree is not None:  # written as a chain, positioned and masked as a tree
            positions, mask = tree_plan(tree, num_new, kv_len)
        width = _cdiv(kv_len, bs)
        if len(slots) == 1:
            table = self._tables[slots[0]][:width]
            if _consecutive(table):
                # consecutive blocks (the common case for a lone sequence): plain slices, no gather
                return AttnMeta(slots=list(slots), slot_index=None, start=start,
                                num_new=list(num_new), positions=positions, write_pos=write_pos, kv_len=kv_len,
                                mask=mask, is_causal=is_causal, row0=table[0] * bs, tree=tree is not None)
        meta = self._gathered(list(slots), start, list(num_new), positions, mask, kv_len, is_causal, device)
        meta.tree = tree is not None
        return meta

    def _gathered(self, slots, start, num_new, positions, mask, kv_len, is_causal, device) -> AttnMeta:
        """The plan of a forward whose blocks are already taken, every key read through its storage row."""
        bs, T, width = self.block_size, positions.shape[1], _cdiv(kv_len, self.block_size)
        tables = torch.tensor([self._tables[s][:width] + [0] * (width - len(self._tables[s][:width]))
                               for s in slots], dtype=torch.long)  # [B, width], short rows padded (masked)
        pos = torch.arange(kv_len)
        read_pos = tables[:, pos // bs] * bs + pos % bs  # [B, kv_len]
        offs = torch.arange(T)[None, :]
        st_t, n_t = torch.tensor(start)[:, None], torch.tensor(num_new)[:, None]
        write_pos = torch.where(offs < n_t, read_pos.gather(1, (st_t + offs).clamp(max=kv_len - 1)), self.scratch)
        return AttnMeta(slots=slots, slot_index=None, start=start,
                        num_new=num_new, positions=positions, write_pos=write_pos.to(device), kv_len=kv_len,
                        mask=mask, is_causal=is_causal, read_pos=read_pos.to(device))

    def _reserve(self, slots: list[int], num_new: list[int]) -> list[int]:
        """Take the blocks for ``num_new`` more positions of each slot and advance their lengths -> the first new
        positions (refused whole, nothing taken, where a row would pass max_seq_len or the blocks run out)."""
        start = [self._lens[s] for s in slots]
        for s, st, n in zip(slots, start, num_new):
            if st + n > self.max_seq_len:
                raise ValueError(f"slot {s}: {st} + {n} tokens exceed max_seq_len {self.max_seq_len}")
        if sum(self.blocks_needed(s, st + n) for s, st, n in zip(slots, start, num_new)) > self.num_free_blocks:
            raise RuntimeError("KV pool exhausted: not enough free blocks for this forward")
        for s, st, n in zip(slots, start, num_new):
            table = self._tables[s]
            while len(table) * self.block_size < st + n:
                table.append(self._take_block())
            self._lens[s] = st + n
        return start

    def extend(self, slot: int, n: int) -> int:
        """Take the blocks for ``n`` more positions of ``slot`` and advance its length, as ``prepare`` does, without
        a plan: for a caller that addresses the storage itself through ``block_table`` (an EAGLE-3 head's round in
        one C++ call, Eagle3Head.native_round). -> the first new position."""
        return self._reserve([slot], [n])[0]

    def storage_rows(self, slot: int, n: int) -> torch.Tensor:
        """[n] int64: the storage row of each position 0 .. n - 1 of ``slot`` (its blocks taken): a range where the
        blocks are consecutive (a lone sequence's common case), else through the block table. For a caller that
        addresses the storage itself (LlamaForCausalLM.native_step) instead of reading a ``prepare``'d plan."""
        bs = self.block_size
        table = self._tables[slot][:_cdiv(n, bs)]
        if _consecutive(table):
            return torch.arange(table[0] * bs, table[0] * bs + n)
        return (torch.tensor(table)[:, None] * bs + torch.arange(bs)).view(-1)[:n]

    def block_table(self, slot: int) -> torch.Tensor:
        """[blocks] int64: the storage block of each block of ``slot``'s positions (position p is storage row
        table[p // block_size] * block_size + p % block_size)."""
        return torch.tensor(self._tables[slot], dtype=torch.long)

    def prepare_run(self, slots: list[int], steps: int, device=None) -> list[AttnMeta]:
        """As the base class's; a lone row whose run crosses into a block not next to its last reads every step
        through storage rows (gathers), not only the steps past the gap: the run's steps share one layout."""
        metas = super().prepare_run(slots, steps, device)
        if len({m.row0 is None for m in metas}) > 1:
            metas = [m if m.row0 is None else self._gathered(m.slots, m.start, m.num_new, m.positions, m.mask,
                                                             m.kv_len, m.is_causal, device or self.device)
                     for m in metas]
        return metas

    def update(self, layer, k, v, meta):
        kc, vc = self.k[layer], self.v[layer]  # [rows, Hkv, D]
        if meta.row0 is not None:
            rows = meta.row0 + meta.write_pos[0]  # [T] storage rows of the new tokens (index_put_: in place)
            kc[rows] = k[0].transpose(0, 1)
            vc[rows] = v[0].transpose(0, 1)
            end = meta.row0 + meta.kv_len
            return kc[meta.row0:end].transpose(0, 1)[None], vc[meta.row0:end].transpose(0, 1)[None]
        kc[meta.write_pos] = k.transpose(1, 2)  # [B, T, Hkv, D] scattered to their rows
        vc[meta.write_pos] = v.transpose(1, 2)
        return kc[meta.read_pos].transpose(1, 2), vc[meta.read_pos].transpose(1, 2)  # [B, Hkv, kv_len, D]

    def update_in_place(self, layer, k, v, meta):
        """The storage and each key's row when rows are gathered (``read_pos``): a wide step's gather copied every
        row's keys and values for every layer (~20% of a 32-row SmolLM2 decode step); consecutive blocks stay
        slices."""
        if meta.row0 is not None or meta.read_pos is None:
            return (*self.update(layer, k, v, meta), None)
        kc, vc = self.k[layer], self.v[layer]
        kc[meta.write_pos] = k.transpose(1, 2)
        vc[meta.write_pos] = v.transpose(1, 2)
        return kc, vc, meta.read_pos
