"""The LoRA adapters each request picks by name (vLLM's ``--lora-modules``, ``LoRARequest``, ``enable_lora``,
``max_loras``, ``max_cpu_loras``): which adapters are loaded (read into memory, up to ``max_cpu_loras``), which of
them sit in a slot of the target's products (model.lora; ``max_loras`` slots: the adapters one batch can mix), and
what each load salts the prefix cache with.

A request names an adapter; the scheduler gives it a slot when it admits it (``acquire``): the adapter's own if it
sits in one, else an empty slot, else the least recently used slot that no running request reads, written in place
from the adapter kept in host memory as a slot takes it (fused and cast at its load: a swap is copies, ~9 ms on
SmolLM2's 30 layers against ~40 ms fusing again; no recompile: the slots' shapes never change). Where every slot
serves a running request's adapter, the request waits and the ones behind it go on (vLLM's scheduler, the same).

Invariants:
- A name sits in at most one slot; slot i (1 ..) is what ``Request.lora`` and the rows' masks read, 0 the base model.
- A slot is written only while no running request reads it (``acquire``'s ``busy``); a loaded adapter is unloaded or
  replaced only while no unfinished request names it (``in_use``): a request keeps the adapter it was added with.
- Every load gets a salt no load had before (``Request.lora_salt``, the prefix cache's): the same name loaded again
  from another directory never meets K/V cached under the old. A load moved in and out of slots keeps its salt (its
  weights, and so its K/V, are the same wherever it sits).
"""

from __future__ import annotations

import os

from ..model.lora import apply_loras, clear_lora, fill_lora, load_lora, reserve_loras, slot_weights


class LoRASlots:
    def __init__(self, model, modules: dict | None, scale: float, enable: bool, slots: int, rank: int,
                 capacity: int | None = None):
        """``slots``: max_loras; ``capacity``: max_cpu_loras, the adapters loaded at once (None: ``slots``)."""
        self.model, self.scale, self.dynamic = model, scale, enable
        self._loads = 0  # loads so far: each one's salt
        self._uses = 0  # slot acquisitions so far: a slot's last one orders the slots by recent use
        # name -> (directory, the adapter fused and cast as a slot takes it (slot_weights; None: applied at start for
        # good), salt), in load order; replaced whole, never changed in place: another thread's snapshot (``loaded``)
        # reads it while the engine loads
        self.known: dict[str, tuple[str, dict | None, int]] = {}
        modules = dict(modules or {})
        if enable:  # fixed slots, filled and emptied in place while the engine runs
            reserve_loras(model, slots, rank)
            self.capacity = max(capacity or slots, slots)
            self.names: list[str | None] = [None] * slots  # the adapter in each slot
            self.used = [0] * slots  # each slot's last acquisition
            for name, path in modules.items():
                self.load(name, path)
        else:  # all loaded at start, each pair as wide as its adapter's rank (no columns to spare), each in its slot
            if modules:
                apply_loras(model, [(load_lora(path), scale) for path in modules.values()])
            self.names, self.used = list(modules), [0] * len(modules)
            self.known = {n: (str(p), None, i) for i, (n, p) in enumerate(modules.items(), 1)}
            self.capacity = self._loads = len(modules)

    @property
    def loaded(self) -> dict[str, str]:
        """name -> directory of every adapter loaded now (in a slot or not), in load order."""
        return {n: v[0] for n, v in self.known.items()}

    def check(self, name: str | None) -> None:
        """ValueError naming the adapters there are, unless ``name`` is one (or None, the base model)."""
        if name is not None and name not in self.known:
            there = f"this engine's adapters are {list(self.known)}" if self.known else \
                "none is loaded (Engine.load_lora, or a LoRARequest with its lora_path)" if self.dynamic else \
                "this engine loads none (EngineConfig.lora_modules)"
            raise ValueError(f"no LoRA adapter named {name!r}: {there}")

    def salt(self, name: str | None) -> int:
        return self.known[name][2] if name is not None else 0

    def path(self, name: str | None) -> str | None:
        return self.known[name][0] if name is not None else None

    def acquire(self, name: str | None, busy: set[int]) -> int | None:
        """The slot a request of adapter ``name`` runs in, the adapter written there if it is not yet: its own slot,
        else an empty one, else the least recently used slot not in ``busy`` (those running requests read). None:
        every slot is busy with other adapters (the request waits). ``name`` None: 0, the base model."""
        if name is None:
            return 0
        if name in self.names:
            slot = self.names.index(name) + 1
        else:
            free = [s for s in range(1, len(self.names) + 1) if s not in busy]
            if not free:
                return None
            slot = min(free, key=lambda s: (self.names[s - 1] is not None, self.used[s - 1]))
            self._write(slot, name)
        self._uses += 1
        self.used[slot - 1] = self._uses
        return slot

    def _write(self, slot: int, name: str) -> None:
        fill_lora(self.model, slot, self.known[name][1])
        self.names[slot - 1] = name

    def load(self, name: str, path: str | os.PathLike, replace: bool = False, in_use: int = 0) -> None:
        """Read the PEFT directory ``path`` as ``name`` (into an empty slot if there is one: its first requests need
        no write); ``replace``: over the adapter loaded as ``name`` (which ``in_use`` unfinished requests name: none
        may). ValueError naming the problem (not enable_lora, a name taken, max_cpu_loras reached, an adapter that
        does not fit), nothing changed."""
        if not self.dynamic:
            raise ValueError("this engine loads adapters at start only: EngineConfig.enable_lora makes room for more")
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"an adapter's name is a non-empty string without outer spaces, got {name!r}")
        if name in self.known and not replace:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already (from {self.known[name][0]})")
        if name in self.known and in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} unfinished request(s): replace it after "
                             "they finish")
        if name not in self.known and len(self.known) >= self.capacity:
            raise ValueError(f"all max_cpu_loras={self.capacity} adapters are loaded ({', '.join(self.known)}): "
                             "unload one first" + ("" if self.capacity > len(self.names) else
                                                   f" (or raise max_cpu_loras: max_loras={len(self.names)} of them "
                                                   "run in one batch, the rest wait in memory)"))
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a PEFT adapter's directory")
        weights = slot_weights(self.model, load_lora(path), self.scale)  # ValueError before anything changes
        self._loads += 1
        self.known = {**self.known, name: (str(path), weights, self._loads)}
        if name in self.names:  # replaced where it sits (no request reads it: in_use is 0)
            self._write(self.names.index(name) + 1, name)
        elif None in self.names:
            self._write(self.names.index(None) + 1, name)

    def unload(self, name: str, in_use: int) -> None:
        """Forget ``name`` and empty its slot; ValueError for an unknown name, or one ``in_use`` unfinished requests
        name."""
        if not self.dynamic:
            raise ValueError("this engine loads adapters at start only (EngineConfig.enable_lora): none is unloaded")
        self.check(name)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} unfinished request(s): unload it after "
                             "they finish")
        if name in self.names:
            slot = self.names.index(name) + 1
            clear_lora(self.model, slot)
            self.names[slot - 1] = None
        self.known = {n: v for n, v in self.known.items() if n != name}
