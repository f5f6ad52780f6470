"""The LoRA adapters each request picks by name (vLLM's ``--lora-modules``, ``LoRARequest``, ``enable_lora``): which
adapter is in which slot of the target's products (model.lora), and what each load salts the prefix cache with.

Invariants:
- A name is in at most one slot; slot i (1 ..) is what ``Request.lora`` and the rows' masks read, 0 the base model.
- Every load gets a salt no load had before (``Request.lora_salt``, the prefix cache's): a slot emptied and filled
  with another adapter, or the same name loaded again from another directory, never meets K/V cached under the old.
- A slot is emptied only when no unfinished request picks it (``unload``'s ``in_use``): a request's rows keep the
  adapter it was admitted with.
"""

from __future__ import annotations

import os

from ..model.lora import apply_loras, clear_lora, fill_lora, load_lora, reserve_loras


class LoRASlots:
    def __init__(self, model, modules: dict | None, scale: float, enable: bool, slots: int, rank: int):
        self.model, self.scale, self.dynamic = model, scale, enable
        self._loads = 0  # loads so far: each one's salt
        modules = dict(modules or {})
        if enable:  # fixed slots, filled and emptied in place while the engine runs
            reserve_loras(model, slots, rank)
            self.names: list[str | None] = [None] * slots
            self.paths: list[str | None] = [None] * slots
            self.salts = [0] * slots
            for name, path in modules.items():
                self.load(name, path)
        else:  # all loaded at start, each pair as wide as its adapter's rank (no columns to spare)
            if modules:
                apply_loras(model, [(load_lora(path), scale) for path in modules.values()])
            self.names, self.paths = list(modules), [str(p) for p in modules.values()]
            self.salts = list(range(1, len(modules) + 1))
            self._loads = len(modules)

    @property
    def loaded(self) -> dict[str, str]:
        """name -> directory of every adapter loaded now, in slot order."""
        return {n: p for n, p in zip(self.names, self.paths) if n is not None}

    def index(self, name: str | None) -> int:
        """The slot of the adapter called ``name`` (None: 0, the base model); ValueError naming the adapters there
        are."""
        if name is None:
            return 0
        if name not in self.names:
            there = f"this engine's adapters are {list(self.loaded)}" if self.loaded else \
                "none is loaded (Engine.load_lora, or a LoRARequest with its lora_path)" if self.dynamic else \
                "this engine loads none (EngineConfig.lora_modules)"
            raise ValueError(f"no LoRA adapter named {name!r}: {there}")
        return self.names.index(name) + 1

    def salt(self, slot: int) -> int:
        return self.salts[slot - 1] if slot else 0

    def load(self, name: str, path: str | os.PathLike, replace: bool = False, in_use: int = 0) -> int:
        """Read the PEFT directory ``path`` into a free slot as ``name`` -> its slot; ``replace``: into the slot of the
        adapter loaded as ``name`` (which ``in_use`` unfinished requests pick: none may). ValueError naming the
        problem (not enable_lora, a name taken, no free slot, an adapter that does not fit), nothing changed."""
        if not self.dynamic:
            raise ValueError("this engine loads adapters at start only: EngineConfig.enable_lora makes room for more")
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"an adapter's name is a non-empty string without outer spaces, got {name!r}")
        if name in self.names and not replace:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already (from "
                             f"{self.paths[self.names.index(name)]})")
        if name in self.names and in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} unfinished request(s): replace it after "
                             "they finish")
        if name not in self.names and None not in self.names:
            raise ValueError(f"all max_loras={len(self.names)} adapter slots are taken ({', '.join(self.loaded)}): "
                             "unload one first")
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a PEFT adapter's directory")
        slot = (self.names.index(name) if name in self.names else self.names.index(None)) + 1
        fill_lora(self.model, slot, load_lora(path), self.scale)  # ValueError before a write
        self._loads += 1
        # the name last: another thread's snapshot (``loaded``) never pairs it with the slot's former directory
        self.paths[slot - 1], self.salts[slot - 1] = str(path), self._loads
        self.names[slot - 1] = name
        return slot

    def unload(self, name: str, in_use: int) -> None:
        """Empty the slot of ``name``; ValueError for an unknown name, or one ``in_use`` unfinished requests pick."""
        if not self.dynamic:
            raise ValueError("this engine loads adapters at start only (EngineConfig.enable_lora): none is unloaded")
        slot = self.index(name)
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is in use by {in_use} unfinished request(s): unload it after "
                             "they finish")
        clear_lora(self.model, slot)
        self.names[slot - 1] = None  # the name first (``load``'s order, reversed)
        self.paths[slot - 1], self.salts[slot - 1] = None, 0
