"""Weights on 2 MiB pages for CPU decoding (Linux transparent huge pages).

A decode step streams every weight once. On 4 KiB pages that is a TLB miss every 4 KiB (~130,000 a step for
SmolLM2 in float32) and the hardware prefetchers stop at each page boundary; on 2 MiB pages both almost vanish.
Measured here (infer::linear over SmolLM2's 121 matrices, interleaved, medians): float32 24.4 -> 26.8 GB/s,
bfloat16 23.1 -> 24.0, int8 20.1 -> 21.8. llama.cpp gets the same for free: it mmaps the GGUF file, and the
page cache holds it in large folios.

Most Linux machines run THP in ``madvise`` mode: only memory that asks for huge pages gets them, and PyTorch's
allocator does not ask. ``place_on_hugepages`` moves a model's parameters and buffers into one 2 MiB-aligned
anonymous mapping advised ``MADV_HUGEPAGE``. The values are copied bit for bit; nothing else changes. Where the
platform has no THP (macOS, Windows, THP off) it does nothing.

``zeroed_on_hugepages`` gives the KV cache the same pages (cache/base.py's kv_storage): a step reads every layer's
keys and values of the sequence, ~1,300 pages of 4 KiB at 200 tokens. Measured (SmolLM2, a 200-400-token context,
one process, two engines alternating 300 times): steps of 1 and 4 tokens 1.5-3.3% faster (medians over four runs,
AMD EPYC Zen 4, 2026-12-05; docs/benchmarks.md, "a verify's extra rows taken apart").
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def hugepages_supported() -> bool:
    """Whether this OS can back memory with transparent huge pages on request."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def zeroed_on_hugepages(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of zeros (uint8) starting on a 2 MiB boundary of an anonymous mapping advised ``MADV_HUGEPAGE``:
    zero pages from the OS, committed as they are first written (as calloc's large blocks are), 2 MiB at a time.
    None where the platform has no THP or the buffer is smaller than one huge page (the caller's own then)."""
    if nbytes < HUGE_PAGE or not hugepages_supported():
        return None
    arena = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP support for anonymous memory
        arena.close()
        return None
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


# One placement at a time: a second engine over the same model places it from its own thread (Engine._start_warmup)
# while the first engine's warm-up thread may be in the middle of it; unserialised, both copied the same tensors
# into two arenas while the other swapped them (a segfault, 1 run in ~5 of tests/test_warmup.py). The second now
# waits and finds the model placed.
_PLACING = threading.Lock()


def placement_lock() -> threading.Lock:
    """Held while ``place_on_hugepages`` copies and swaps a model's tensors: an in-place write to a buffer
    (model.lora.fill_lora) takes it, so that it is not made to a tensor being replaced."""
    return _PLACING


def place_on_hugepages(model: nn.Module) -> int:
    """Move ``model``'s CPU parameters and buffers onto huge pages, in place; returns the bytes moved (0: nothing).

    Tied weights stay tied (a parameter shared by two modules is one tensor, moved once). The mapping lives as long
    as any tensor in it does (each holds a reference to it). A model already placed is left as it is (0).
    """
    with _PLACING:
        return _place(model)


def _place(model: nn.Module) -> int:
    """The body of place_on_hugepages, under its lock."""
    if not hugepages_supported() or getattr(model, "_on_hugepages", False):
        return 0
    params = {id(p): p for p in model.parameters() if p.device.type == "cpu"}
    buffers = {id(b): b for b in model.buffers() if b.device.type == "cpu"}
    tensors = [t for t in (*params.values(), *buffers.values()) if t.is_contiguous() and t.numel() > 0]
    if not tensors:
        return 0
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP support for anonymous memory
        arena.close()
        return 0
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive
    start = -raw.data_ptr() % HUGE_PAGE  # the first byte on a 2 MiB boundary
    moved: dict[int, torch.Tensor] = {}
    for t, off in zip(tensors, offsets):
        new = raw[start + off:start + off + t.nbytes].view(t.dtype).view(t.shape)
        new.copy_(t)
        moved[id(t)] = new
    with torch.no_grad():
        for p in params.values():
            if id(p) in moved:
                p.data = moved[id(p)]  # the same Parameter object: every module that shares it sees the move
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and id(b) in moved:
                    module._buffers[name] = moved[id(b)]
    model._on_hugepages = True
    return sum(t.nbytes for t in tensors)
