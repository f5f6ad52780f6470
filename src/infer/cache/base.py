"""The KV cache pool seam: what the model needs from any KV storage.

A pool owns the key/value tensors of every layer for many sequences. A sequence lives in a *slot*; a slot's
length is the number of positions whose K/V are valid. The life of one forward pass:

    meta = pool.prepare(slots, num_new)       # host-side: positions, write addresses, mask; lengths advance
    hidden = model(input_ids, meta.positions, pool, meta)   # each layer calls pool.update(layer, k, v, meta)
    pool.truncate_to(slot, n)                 # optional rollback (speculative rejection): just a length

A token tree (spec_decode.tree) is one forward too: ``prepare(slots, num_new, tree=TreeAttn(...))`` writes the
nodes at consecutive cache columns as any append does, but gives each its own rotary position (its depth) and lets
it see only the columns of its ancestors in the tree. After verification ``move(slot, src, dst)`` copies the few
accepted nodes' entries to the positions their tokens hold in the sequence, and ``truncate_to`` drops the rest.

Invariants every implementation keeps:
- positions of a slot are 0..len-1 and contiguous; a forward writes exactly positions len..len+n-1;
- ``truncate_to`` never copies cache data: it resets a length (and frees whole trailing pages where paged);
- ``move`` copies only the entries it names (a tree's accepted path), never a whole slot;
- entries beyond a slot's length are garbage and are never attended to (the mask or the slice excludes them);
- padded query rows (a batch row with fewer new tokens than the widest) write to a scratch location, never
  over a valid entry of any slot;
- storage is written only by ``update`` (addressed entirely by the AttnMeta) and by copies that go through
  ``_replay`` (addressed by storage coordinates, not by slot bookkeeping): a pool of the same ``layout()`` that
  receives the same metas and replays fed to it ends with the same contents. The tensor-parallel executor
  (engine.tp_executor) keeps every worker's shard of the pool in step that way, with no bookkeeping of its own.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttnMeta:
    """Everything one forward pass needs to address the cache; built once per forward, shared by all layers."""

    slots: list[int]  # host copy, one per batch row
    # [B] long: the rows' slots as a tensor, which a slotted pool indexes its storage by; None where the pool reads
    # keys by storage rows (paged), which never needs it (one tensor fewer to build a forward, each a cold op)
    slot_index: torch.Tensor | None
    start: list[int]  # host: first new position per row
    num_new: list[int]  # host: valid new tokens per row (<= T)
    positions: torch.Tensor  # [B, T] long, rotary positions (pad rows clamped to a valid value)
    write_pos: torch.Tensor  # [B, T] long, cache column each query's K/V goes to (pads -> scratch column)
    kv_len: int  # keys attended: max(start + num_new)
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool (True = attend) or None when no masking is needed
    is_causal: bool  # True when a plain causal mask over kv_len == T suffices (fresh single-row prefill)
    read_pos: torch.Tensor | None = None  # [B, kv_len] long, paged pools: storage row of each attended key
    row0: int | None = None  # paged, one row whose blocks are consecutive: storage row of position 0 (slices)
    # [B] int64 on the CPU, num_new as a tensor, in every forward of T > 1 tokens a row (set here): the CPU kernels
    # skip a row's pads past it (kernels/rows.h). A verify pads its rows to the longest's drafts; each pad cost what
    # a real token does (~0.2 of a decode step on a 2-core CPU), so rows drafting unequal K paid for the longest.
    lens: torch.Tensor | None = None
    tree: bool = False  # the rows are token trees (TreeAttn): positioned and masked as trees, not chains
    # [B] long: each row's LoRA adapter (1, 2, ...; 0: the base model) where the target carries per-request adapters
    # (model.lora.apply_loras) and a row of the batch has one; None: no row has (set by the caller after prepare)
    adapters: torch.Tensor | None = None

    # a fresh prefill's causal mask, built by kernel_mask for the first layer and shared by the others
    _causal: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.lens is None and self.positions.shape[-1] > 1:
            self.lens = torch.tensor(self.num_new)

    def kernel_mask(self) -> torch.Tensor | None:
        """The mask for ``infer::attention``, which has no causal flag: ``mask``, or where ``is_causal`` leaves it
        None (SDPA's is_causal does the work) the plain causal mask ``[1, 1, T, T]``, built once for all layers."""
        if not self.is_causal or self.mask is not None:
            return self.mask
        if self._causal is None:
            T = self.positions.shape[-1]
            self._causal = torch.ones(T, T, dtype=torch.bool, device=self.positions.device).tril_()[None, None]
        return self._causal

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def single(self) -> bool:
        """One row writing a contiguous run: the cache can use slices instead of gathers."""
        return len(self.slots) == 1


@dataclass
class TreeAttn:
    """How a forward's new tokens form trees: rotary positions and, over the columns from ``base`` on, who sees whom.

    Query i of row b sits at rotary position ``positions[b, i]`` (its depth below the row's root, plus the root's
    position) and sees every key at a column < base[b] (the context) and the columns base[b] + w for which
    ``visible[b, i, w]`` is True (its ancestors and itself, among the tree's nodes written so far and now)."""

    positions: torch.Tensor  # [B, T] long
    base: list[int]  # per row: the cache column of the tree's first node
    visible: torch.Tensor  # [B, T, W] bool, W >= (start - base) + T for every row


def kv_storage(shape: tuple, dtype: torch.dtype, device: torch.device, lazy: bool = False) -> torch.Tensor:
    """One layer's K or V storage, zero-filled: masked keys still meet the attention matmul with weight 0, and
    0 * NaN from uninitialised memory would poison the row. On the CPU the zeros come from calloc (numpy), whose
    large blocks are fresh anonymous pages, zero by the OS and committed only when first written: a pool sized for
    every slot's longest sequence (~0.8 GB for SmolLM2) costs nothing until used, where torch.zeros writes it all at
    start-up (~3 s here). Where the OS offers transparent huge pages, the same zeros come on 2 MiB pages
    (model.hugepages.zeroed_on_hugepages): a step reads every layer's keys and values, and on 4 KiB pages SmolLM2's
    steps were 1.5-3.3% slower. ``lazy``: not even zeroed (KVCachePool.twin, whose results are thrown away)."""
    if lazy:
        return torch.empty(shape, dtype=dtype, device=device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    from ..model.hugepages import zeroed_on_hugepages  # here: infer.model imports the cache pools

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = zeroed_on_hugepages(nbytes)
    if raw is None:
        raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class KVCachePool(ABC):
    """Storage of K/V for many sequences, addressed by (slot, position)."""

    num_layers: int
    max_seq_len: int
    # called as mirror(pool, op, args) before each storage copy outside a forward (_replay): the tensor-parallel
    # executor forwards it to the workers' pools
    mirror = None

    @abstractmethod
    def layout(self) -> dict:
        """The keyword arguments of ``for_model(model, **layout)`` that build a pool addressed exactly like this one
        (for another shard of the model: its own KV heads)."""

    def twin(self, model, spare_slots: int = 0) -> KVCachePool:
        """A pool addressed exactly like this one (``layout``) over storage of its own, allocated lazily (pages are
        committed only where written) and never zeroed: for running steps whose results are thrown away, such as
        compiling graphs off the engine's thread (engine.warmup), without touching this pool. ``spare_slots``: that
        many slots more (storage is addressed by position, not by slot: the same graphs serve both)."""
        layout = self.layout()
        return type(self).for_model(model, **{**layout, "max_slots": layout["max_slots"] + spare_slots}, lazy=True)

    def _replay(self, op: str, *args) -> None:
        """Run the storage copy ``self.<op>(*args)`` (plain ints and lists: storage coordinates), announcing it to
        ``mirror`` first."""
        if self.mirror is not None:
            self.mirror(self, op, args)
        getattr(self, op)(*args)

    @abstractmethod
    def allocate(self, num_tokens: int = 0, prefix_ids: list[int] | None = None, salt: int = 0) -> int:
        """Reserve a slot for a sequence of up to ``num_tokens`` positions; returns the slot id. Raises if none is free.

        With ``prefix_ids`` a pool with a prefix cache may start the slot at ``seq_len(slot) > 0``: the K/V of a
        cached prefix of those ids (never all of them: the last token is always recomputed for its logits) offered
        under the same ``salt`` (what else the K/V depends on: a request's LoRA adapter).
        """

    @abstractmethod
    def can_fit(self, demands: list[tuple[int | None, int]]) -> bool:
        """Ask before doing: could every ``(slot, new_len)`` grow to ``new_len`` positions at once?

        ``slot=None`` stands for a sequence not yet allocated (it needs a free slot too). Prefix-cache hits are not
        counted, so the answer is conservative.
        """

    @abstractmethod
    def free(self, slot: int) -> None:
        """Release a slot and everything it holds."""

    @abstractmethod
    def seq_len(self, slot: int) -> int:
        """Valid positions in ``slot``."""

    @abstractmethod
    def truncate_to(self, slot: int, new_len: int) -> None:
        """Roll ``slot`` back to ``new_len`` valid positions (``new_len`` <= current length). Copies nothing."""

    def _check_truncate(self, slot: int, new_len: int) -> None:
        """The shared precondition of ``truncate_to``: rollback only shortens."""
        if not 0 <= new_len <= self.seq_len(slot):
            raise ValueError(f"truncate_to({slot}, {new_len}): slot holds {self.seq_len(slot)} positions")

    @abstractmethod
    def free_token_capacity(self) -> int:
        """Positions that can still be written across the pool (a fresh pool returns its total capacity)."""

    def cache_prefix(self, slot: int, token_ids: list[int], salt: int = 0, num_valid: int | None = None) -> None:
        """Offer the computed K/V of ``token_ids`` (the prompt in ``slot``) to the prefix cache, found again only by
        an ``allocate`` with the same ``salt``; ``num_valid``: only the slot's first positions hold what the prompt
        says (a feature head's later entries were predicted). Default: none."""

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: later prompts compute theirs again (slots in use keep what they hold).
        Returns the number of blocks forgotten. Default: none (no prefix cache)."""
        return 0

    @property
    def num_used_slots(self) -> int:
        return 0

    @abstractmethod
    def prepare(self, slots: list[int], num_new: list[int], device: torch.device | None = None,
                tree: TreeAttn | None = None) -> AttnMeta:
        """Plan a forward that appends ``num_new[i]`` tokens to ``slots[i]``; advances the lengths. With ``tree`` the
        new tokens are tree nodes (TreeAttn): written where a chain would be, positioned and masked as a tree."""

    def prepare_run(self, slots: list[int], steps: int, device: torch.device | None = None) -> list[AttnMeta]:
        """Plan ``steps`` forwards of one token a row, one after another (``prepare`` ``steps`` times), all addressed
        alike (the same kind of plan), so that a compiled run of steps (EagleHead.draft_chain) meets one layout."""
        return [self.prepare(slots, [1] * len(slots), device) for _ in range(steps)]

    @abstractmethod
    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V at positions ``src`` of ``slot`` to positions ``dst`` (every layer; all reads before any
        write). Tree compaction: the accepted path's nodes move to the positions their tokens hold."""

    @abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new K/V (``[B, Hkv, T, D]``) and return the K/V to attend to (``[B, Hkv, kv_len, D]``)."""

    def update_in_place(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                        meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``update`` for ``infer::attention``, which can read keys where they lie: (k, v, None) as ``update`` returns
        them, or a paged pool's storage (``[R, Hkv, D]``) with each attended key's storage row (``[B, kv_len]``), so
        that no gathered copy of the rows' keys and values is made. The same values either way."""
        return (*self.update(layer, k, v, meta), None)


def tree_plan(tree: TreeAttn, num_new: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary positions [B, T], mask [B, 1, T, kv_len]) of a tree forward (TreeAttn). Pad queries keep the context
    (a finite output, discarded)."""
    dev = tree.visible.device
    B, T, W = tree.visible.shape
    keys = torch.arange(kv_len, device=dev)
    rel = keys[None, :] - torch.tensor(tree.base, device=dev)[:, None]  # [B, kv_len] column - base
    in_tree = (rel >= 0) & (rel < W)
    vis = tree.visible.gather(2, rel.clamp(0, W - 1)[:, None, :].expand(B, T, kv_len)) & in_tree[:, None, :]
    mask = (rel < 0)[:, None, :] | vis  # [B, T, kv_len]
    return tree.positions, mask[:, None]


def build_positions(start: list[int], num_new: list[int], device) -> tuple[torch.Tensor, torch.Tensor | None, int, bool]:
    """Rotary positions ``[B, T]``, the attention mask and kv_len for rows that append after ``start``.

    Query i of row b sits at position start[b] + i and may attend key j iff j <= start[b] + i (causality; keys
    beyond a row's own length are therefore excluded too). Pad queries (i >= num_new[b]) are clamped to the
    row's last valid position: their outputs are discarded, they only need finite values.
    """
    B, T = len(start), max(num_new)
    kv_len = max(s + n for s, n in zip(start, num_new))
    if B == 1:
        positions = torch.arange(start[0], start[0] + T, device=device).unsqueeze(0)
        if T == 1:
            return positions, None, kv_len, False  # decode: every cached key is visible
        if start[0] == 0:
            return positions, None, kv_len, True  # fresh prefill: plain causal
    else:
        st = torch.tensor(start, device=device)
        last = torch.tensor([s + n - 1 for s, n in zip(start, num_new)], device=device)
        positions = torch.minimum(st[:, None] + torch.arange(T, device=device)[None, :], last[:, None])
    keys = torch.arange(kv_len, device=device)
    mask = keys[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, kv_len]
    return positions, mask, kv_len, False
