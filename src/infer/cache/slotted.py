"""Contiguous per-slot KV storage: one ``[max_seq_len]`` run of positions per slot.

Layout ``k[layer, slot, kv_head, position, head_dim]`` keeps one slot's keys for one head contiguous, so a
single-sequence decode reads a plain slice (no gather, no copy). Column ``max_seq_len`` is a scratch sink for
the K/V of padded query rows.
"""

from __future__ import annotations

import torch

from .base import AttnMeta, KVCachePool, TreeAttn, build_positions, kv_storage, tree_plan


class SlottedKVCache(KVCachePool):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        max_slots: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        lazy: bool = False,  # storage left unzeroed and uncommitted (KVCachePool.twin): results are thrown away
    ):
        if max_seq_len <= 0 or max_slots <= 0:
            raise ValueError(f"max_seq_len and max_slots must be > 0, got {max_seq_len}, {max_slots}")
        self.num_layers, self.max_seq_len, self.max_slots = num_layers, max_seq_len, max_slots
        self.device = torch.device(device)
        shape = (max_slots, num_kv_heads, max_seq_len + 1, head_dim)
        # zeros (kv_storage says why, and why they cost nothing until written)
        # One tensor per layer, not views of one: under torch.compile a write into a view of a larger input is
        # functionalised into a copy of the whole base; a write into a tensor of its own is done in place.
        self.k = [kv_storage(shape, dtype, self.device, lazy) for _ in range(num_layers)]
        self.v = [kv_storage(shape, dtype, self.device, lazy) for _ in range(num_layers)]
        self._lens = [0] * max_slots
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._used: set[int] = set()

    @classmethod
    def for_model(cls, model, max_seq_len: int, max_slots: int = 1, lazy: bool = False) -> SlottedKVCache:
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_seq_len, max_slots,
                   dtype=p.dtype, device=p.device, lazy=lazy)

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def allocate(self, num_tokens: int = 0, prefix_ids: list[int] | None = None, salt: int = 0) -> int:
        if num_tokens > self.max_seq_len:
            raise ValueError(f"{num_tokens} tokens exceed the cache's max_seq_len {self.max_seq_len}")
        if not self._free:
            raise RuntimeError(f"no free KV slot (all {self.max_slots} in use)")
        slot = self._free.pop()
        self._used.add(slot)
        self._lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._lens[slot] = 0
        self._free.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._lens[slot]

    def truncate_to(self, slot: int, new_len: int) -> None:
        self._check_truncate(slot, new_len)
        self._lens[slot] = new_len

    def can_fit(self, demands: list[tuple[int | None, int]]) -> bool:
        new = sum(1 for slot, _ in demands if slot is None)
        return new <= len(self._free) and all(n <= self.max_seq_len for _, n in demands)

    @property
    def num_used_slots(self) -> int:
        return len(self._used)

    def free_token_capacity(self) -> int:
        return len(self._free) * self.max_seq_len + sum(self.max_seq_len - self._lens[s] for s in self._used)

    def copy_slot(self, src: list[int], dst: list[int]) -> None:
        """Copy whole slots (beam search reorders beams; this is not a rollback path)."""
        if not src:
            return
        self._replay("_copy_slots", list(src), list(dst))
        lens = [self._lens[s] for s in src]
        for d, n in zip(dst, lens):
            self._lens[d] = n

    def _copy_slots(self, src: list[int], dst: list[int]) -> None:
        si = torch.tensor(src, dtype=torch.long, device=self.device)
        di = torch.tensor(dst, dtype=torch.long, device=self.device)
        for kc, vc in zip(self.k, self.v):
            kc[di], vc[di] = kc[si], vc[si]

    def layout(self) -> dict:
        return {"max_seq_len": self.max_seq_len, "max_slots": self.max_slots}

    # -- forward -----------------------------------------------------------------------------------------------
    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        if src:
            self._replay("_move_columns", slot, list(src), list(dst))

    def _move_columns(self, slot: int, src: list[int], dst: list[int]) -> None:
        si = torch.tensor(src, dtype=torch.long, device=self.device)
        di = torch.tensor(dst, dtype=torch.long, device=self.device)
        for kc, vc in zip(self.k, self.v):  # advanced indexing reads into a new tensor first: overlaps are safe
            kc[slot, :, di], vc[slot, :, di] = kc[slot, :, si], vc[slot, :, si]

    def prepare(self, slots: list[int], num_new: list[int], device=None, tree: TreeAttn | None = None) -> AttnMeta:
        device = device or self.device
        start = [self._lens[s] for s in slots]
        for s, st, n in zip(slots, start, num_new):
            if s not in self._used:
                raise ValueError(f"slot {s} is not allocated")
            if st + n > self.max_seq_len:
                raise ValueError(f"slot {s}: {st} + {n} tokens exceed max_seq_len {self.max_seq_len}")
        positions, mask, kv_len, is_causal = build_positions(start, num_new, device)
        T = positions.shape[1]
        if len(slots) == 1:
            write_pos = positions  # contiguous run; update() uses a slice
        else:
            offs = torch.arange(T, device=device)[None, :]
            st = torch.tensor(start, device=device)[:, None]
            n = torch.tensor(num_new, device=device)[:, None]
            write_pos = torch.where(offs < n, st + offs, self.max_seq_len)  # pads -> scratch column
        for s, st, n in zip(slots, start, num_new):
            self._lens[s] = st + n
        if tree is not None:  # written as a chain, positioned and masked as a tree
            positions, mask = tree_plan(tree, num_new, kv_len)
        return AttnMeta(slots=list(slots), slot_index=torch.tensor(slots, device=device), start=start,
                        num_new=list(num_new), positions=positions, write_pos=write_pos, kv_len=kv_len,
                        mask=mask, is_causal=is_causal, tree=tree is not None)

    def update(self, layer, k, v, meta):
        kc, vc = self.k[layer], self.v[layer]  # [S, Hkv, L+1, D]
        # Writes are index_put_ on the layer's own tensor (compiled, it stays in place; a slice assignment with a
        # symbolic start would be functionalised into a copy of the whole layer).
        # Advanced indices around a slice put the indexed dims first: kc[slot, :, pos] is [B, T, Hkv, D].
        rows = meta.slot_index[:, None]
        kc[rows, :, meta.write_pos] = k.transpose(1, 2)
        vc[rows, :, meta.write_pos] = v.transpose(1, 2)
        if meta.single:  # one slot: attend to a slice of it, no gather
            s = meta.slots[0]
            return kc[s:s + 1, :, :meta.kv_len], vc[s:s + 1, :, :meta.kv_len]
        return kc[meta.slot_index, :, :meta.kv_len], vc[meta.slot_index, :, :meta.kv_len]
