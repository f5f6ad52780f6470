"""LoRA adapters (PEFT's saved format, as vLLM's ``--lora-modules`` and llama.cpp's ``--lora`` read them) applied to
the target at run time: y = W x + s * B (A x), W as loaded (float or llama.cpp's quantized blocks, never re-rounded)
and s = lora_alpha / r (PEFT's ``use_rslora``: / sqrt(r)) times the user's scale (llama.cpp's ``--lora-scaled``).

Why at run time and not merged: a quantized W cannot take B A without being rounded again, which changes the
model; the two products are r-wide (r ~8-64 against 576-1536), a few percent of a step. The adapter's modules
(q, k, v, o, gate, up, down projections) are fused as our layers are: q/k/v's A matrices stacked into one
[r_q + r_k + r_v, in] product and their B's into one block-diagonal [q + k + v, r_q + r_k + r_v] (a module the
adapter leaves out has no rows there), gate/up's the same, s folded into B. The products go through ``linear``
like every float product: a row's result does not depend on the rows beside it, so decode and verify stay
bit-identical and speculation stays lossless with an adapter on. The one-call forward (kernels/lm_round.cpp) takes
each product's A and B beside its blocks and adds the delta with the same two kernels and the same bfloat16 add.

Several adapters, each request picking one by name (vLLM's ``--lora-modules`` and ``LoRARequest``: ``apply_loras``):
one pair of products per adapter, each row zeroing the pairs that are not its adapter's (``LoRALinear``), so requests
of different adapters and of none share a batch, and a lone row computes its own adapter's pair alone.

Adapters loaded after start (vLLM's ``enable_lora`` / ``max_loras`` / ``max_lora_rank``, its ``LoRARequest`` with a
path and its ``/v1/load_lora_adapter``): ``reserve_loras`` wraps every product at start with ``max_loras`` empty
slots of ``max_lora_rank`` columns per adapted part, and ``fill_lora`` / ``clear_lora`` write a slot in place. The
shapes never change, so a compiled step's graphs (which hold the buffers themselves: model.compile) read the new
adapter without a recompile; a smaller rank leaves zero columns, whose terms add exactly 0.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .layers import linear

# PEFT's module names -> (our fused module, part index within it)
_PARTS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
          "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0),
          "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter as read: per (layer, PEFT module) its A [r, in] and B [out, r] (float32) and its scaling."""

    path: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's name for a request's adapter, picked by ``lora_name``: one the engine loaded (``lora_modules``, or an
    earlier request's), or, on an engine with ``enable_lora``, the PEFT directory ``lora_path`` loaded into a free
    slot on first use (LLM.generate). ``lora_int_id`` is vLLM's field, kept for its callers' code and not read."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


def load_lora(path: str | os.PathLike) -> LoRAAdapter:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors); ValueError naming what this
    runtime cannot apply (DoRA, biases, modules saved whole, targets other than the attention and MLP projections)."""
    from safetensors import safe_open

    root = Path(path)
    cfg_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    for f in (cfg_file, weights_file):
        if not f.is_file():
            raise ValueError(f"LoRA adapter {root}: no {f.name} (a PEFT LoRA directory holds adapter_config.json and "
                             "adapter_model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {root}: adapter_config.json is not JSON ({e})") from None
    refusals = [(cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r} (only LORA)"),
                (bool(cfg.get("use_dora")), "use_dora (DoRA's magnitude vectors)"),
                (cfg.get("bias", "none") != "none", f"bias {cfg.get('bias')!r} (only 'none')"),
                (bool(cfg.get("modules_to_save")), f"modules_to_save {cfg.get('modules_to_save')}"),
                (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D weights, not a Llama's)"),
                (bool(cfg.get("alpha_pattern")), "alpha_pattern (a per-module lora_alpha)")]
    bad = [why for refused, why in refusals if refused]
    if bad:
        raise ValueError(f"LoRA adapter {root}: cannot apply {', '.join(bad)}")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {root}: adapter_config.json has no numeric lora_alpha")
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt", device="cpu") as f:
        for name in f.keys():
            m = _KEY.match(name)
            if m is None or m.group(2) not in _PARTS:
                raise ValueError(f"LoRA adapter {root}: tensor {name!r} adapts a module this runtime does not (only "
                                 f"the layers' {', '.join(_PARTS)})")
            pieces.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(name).float()
    if not pieces:
        raise ValueError(f"LoRA adapter {root}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {root}: layer {layer}'s {module} has lora_{'A' if 'A' not in ab else 'B'} "
                             "missing")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {root}: layer {layer}'s {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}: not [r, in] and [out, r]")
        r = a.shape[0]
        weights[layer, module] = (a, b, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r))
    return LoRAAdapter(str(root), weights)


class _LoRAPair(nn.Module):
    """One adapter's A [r, in] and B [out, r] (its scaling folded into B) on one product, for the rows of adapter
    ``adapter`` (1, 2, ...: Request.lora). Buffers of a module of their own, so that huge pages' move of every buffer
    (model.hugepages) and a compiled graph see the same tensors as ``LoRALinear``."""

    def __init__(self, adapter: int, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.adapter = adapter
        self.register_buffer("a", a)
        self.register_buffer("b", b)


class LoRALinear(nn.Module):
    """A projection plus its adapters: base(x) + B_s (A x) in the model's dtype.

    One adapter on every row (``per_request`` False: EngineConfig.lora), or several that each request picks from
    (EngineConfig.lora_modules, enable_lora's slots): one pair of thin products per adapter, each row's A x zeroed
    where the pair is not its adapter's (``adapters`` [B]: each row's, 0 for the base model alone), the pairs' deltas
    summed. A row's delta is then its own adapter's products plus exact zeros, whatever its neighbours pick: the same
    bits as those two products alone, which is what the one-call forward computes for a lone row (its ``pair``), so
    a row's tokens do not depend on its batch and a lone row pays for its own adapter's rank only. (punica's SGMV
    groups the rows by adapter instead; the pairs' shapes here do not depend on the batch's mix, which a compiled
    step needs.)"""

    def __init__(self, base: nn.Module, pairs: list[_LoRAPair], per_request: bool, slotted: bool = False):
        super().__init__()
        self.base = base
        self.pairs = nn.ModuleList(pairs)
        self.per_request = per_request  # whether each row picks its adapter (``forward``'s ``adapters``)
        self.slotted = slotted  # pairs reserved at start and written in place (reserve_loras)

    @property
    def out_features(self) -> int:
        return self.pairs[0].b.shape[0]

    def pair(self, adapter: int) -> _LoRAPair | None:
        """The pair a row of ``adapter`` adds (None: it adds nothing here); the one adapter's where not per request."""
        if not self.per_request:
            return self.pairs[0]
        return next((p for p in self.pairs if p.adapter == adapter), None)

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None,
                adapters: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base(x, lens)
        if not self.per_request:
            p = self.pairs[0]
            return y + linear(linear(x, p.a, None, lens), p.b, None, lens)
        if adapters is None:  # no row of the batch has an adapter
            return y
        rows = adapters.view(-1, *[1] * (x.dim() - 1))  # [B, 1, 1]
        delta = None
        for p in self.pairs:
            d = linear(linear(x, p.a, None, lens) * (rows == p.adapter).to(x.dtype), p.b, None, lens)
            delta = d if delta is None else delta + d  # the other pairs' terms: exactly 0 for this row
        return y + delta


def _check_fits(model, adapter: LoRAAdapter, sizes: dict, ins: dict) -> None:
    cfg = model.config
    for (layer, module), (a, b, _) in adapter.weights.items():
        target, part = _PARTS[module]
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"LoRA adapter {adapter.path}: adapts layer {layer}, the model has "
                             f"{cfg.num_hidden_layers}")
        if a.shape[1] != ins[target] or b.shape[0] != sizes[target][part]:
            raise ValueError(f"LoRA adapter {adapter.path}: layer {layer}'s {module} maps {a.shape[1]} -> "
                             f"{b.shape[0]}, the model's {ins[target]} -> {sizes[target][part]}")


def _fused(adapter: LoRAAdapter, scale: float, sizes: dict) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Per (layer, our fused module): the adapter's A [R, in] (its parts' stacked) and block-diagonal B [out, R]
    (one block per adapted part, its scaling folded in)."""
    parts_of: dict[tuple[int, str], list] = {}
    for (layer, module), (a, b, s) in adapter.weights.items():
        target, part = _PARTS[module]
        parts_of.setdefault((layer, target), []).append((part, a, b * (s * scale)))
    fused = {}
    for (layer, target), parts in parts_of.items():
        offsets = [0]
        for n in sizes[target]:
            offsets.append(offsets[-1] + n)
        a_all = torch.cat([a for _, a, _ in parts])  # [R, in]
        b_all = torch.zeros(offsets[-1], a_all.shape[0])  # [out, R]: block-diagonal, one block per adapted part
        col = 0
        for part, a, b in parts:
            b_all[offsets[part]:offsets[part + 1], col:col + a.shape[0]] = b
            col += a.shape[0]
        fused[layer, target] = (a_all, b_all)
    return fused


def apply_lora(model, adapter: LoRAAdapter, scale: float = 1.0) -> None:
    """Wrap the target's projections that ``adapter`` adapts, for every row (in place); ValueError where its shapes
    or layers do not fit this model, before anything is changed."""
    _wrap(model, [(adapter, scale)], per_request=False)


def apply_loras(model, adapters: list[tuple[LoRAAdapter, float]]) -> None:
    """Wrap the target's projections that any of ``adapters`` adapts, each row picking its own by number (1, 2, ...
    in this order; 0: none) through ``AttnMeta.adapters``; ValueError as ``apply_lora``'s."""
    _wrap(model, adapters, per_request=True)


def _shapes(model) -> tuple[dict, dict]:
    """Per fused module: its parts' output sizes, and its input size."""
    cfg = model.config
    sizes = {"self_attn.qkv_proj": [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim]
             * 2, "self_attn.o_proj": [cfg.hidden_size],
             "mlp.gate_up_proj": [cfg.intermediate_size] * 2, "mlp.down_proj": [cfg.hidden_size]}
    ins = {"self_attn.qkv_proj": cfg.hidden_size, "self_attn.o_proj": cfg.num_attention_heads * cfg.head_dim,
           "mlp.gate_up_proj": cfg.hidden_size, "mlp.down_proj": cfg.intermediate_size}
    return sizes, ins


def _wrap(model, adapters: list[tuple[LoRAAdapter, float]], per_request: bool) -> None:
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("this model carries a LoRA adapter already")
    sizes, ins = _shapes(model)
    for adapter, _ in adapters:
        _check_fits(model, adapter, sizes, ins)
    fused = [_fused(adapter, scale, sizes) for adapter, scale in adapters]
    w = dict(dtype=model.dtype, device=model.device)
    for layer, target in sorted({key for f in fused for key in f}):
        pairs = [_LoRAPair(j + 1, a.to(**w), b.to(**w)) for j, f in enumerate(fused) if (layer, target) in f
                 for a, b in [f[layer, target]]]
        parent_name, attr = target.split(".")
        parent = getattr(model.layers[layer], parent_name)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), pairs, per_request))
    model.lora_adapters = len(adapters) if per_request else 0
    model._native_key = None  # the one-call forward's check reads the module types again (LlamaForCausalLM)


def reserve_loras(model, slots: int, rank: int) -> None:
    """Wrap every layer's four products with ``slots`` empty adapter slots (1 .. slots; Request.lora) of ``rank``
    columns per part (q, k and v: 3 x rank in qkv's), all zero until ``fill_lora`` writes one."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("this model carries a LoRA adapter already")
    sizes, ins = _shapes(model)
    w = dict(dtype=model.dtype, device=model.device)
    for layer in model.layers:
        for target, parts in sizes.items():
            width = len(parts) * rank
            pairs = [_LoRAPair(s, torch.zeros(width, ins[target], **w), torch.zeros(sum(parts), width, **w))
                     for s in range(1, slots + 1)]
            parent_name, attr = target.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), pairs, True, slotted=True))
    model.lora_adapters, model.lora_rank = slots, rank
    model._native_key = None


def _slots(model) -> dict[tuple[int, str], LoRALinear]:
    found = {(i, f"{p}.{a}"): getattr(getattr(layer, p), a) for i, layer in enumerate(model.layers)
             for p, a in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                          ("mlp", "down_proj"))}
    if not all(isinstance(m, LoRALinear) and m.slotted for m in found.values()):
        raise ValueError("this model has no adapter slots (reserve_loras)")
    return found


def check_lora(model, adapter: LoRAAdapter) -> None:
    """ValueError where ``adapter`` does not fit this model's slots (reserve_loras): its shapes, or a rank above them."""
    _slots(model)
    sizes, ins = _shapes(model)
    _check_fits(model, adapter, sizes, ins)
    rank = model.lora_rank
    big = sorted({(m, a.shape[0]) for (_, m), (a, _, _) in adapter.weights.items() if a.shape[0] > rank})
    if big:
        raise ValueError(f"LoRA adapter {adapter.path}: rank {big[0][1]} ({big[0][0]}) is above this engine's "
                         f"max_lora_rank {rank}")


def slot_weights(model, adapter: LoRAAdapter, scale: float = 1.0) -> dict:
    """``adapter`` checked against this model's slots (``check_lora``'s ValueError) and fused as ``fill_lora`` writes
    it, in the slots' dtype: an engine keeps this per loaded adapter, so that moving one into a slot is copies only
    (fusing SmolLM2's 30 layers costs more than the copies: ~20 ms against ~9 on 2 cores). It stays in host memory,
    as vLLM's max_cpu_loras adapters do: on a GPU only the slots take device memory."""
    check_lora(model, adapter)
    sizes, _ = _shapes(model)
    return {key: (a.to(model.dtype), b.to(model.dtype)) for key, (a, b) in _fused(adapter, scale, sizes).items()}


def fill_lora(model, slot: int, adapter: LoRAAdapter | dict, scale: float = 1.0) -> None:
    """Write ``adapter`` (as read, or its ``slot_weights``) into ``slot`` (1 ..), in place: the modules and their
    buffers stay the ones a compiled graph holds. ValueError, before anything is written, where it does not fit this
    model or a slot's rank."""
    from .hugepages import placement_lock

    fused = adapter if isinstance(adapter, dict) else slot_weights(model, adapter, scale)
    mods = _slots(model)
    with placement_lock(), torch.no_grad():  # not while huge pages swap the buffers (engine.warmup's thread)
        for key, mod in mods.items():
            p = mod.pair(slot)
            if key in fused:
                a, b = fused[key]  # [r, in], [out, r]: the slot's first r columns, the rest zero
                p.a[:a.shape[0]].copy_(a)
                p.a[a.shape[0]:].zero_()
                p.b[:, :a.shape[0]].copy_(b)
                p.b[:, a.shape[0]:].zero_()
            else:
                p.a.zero_()
                p.b.zero_()
    model._native_lora = {}  # which products the one-call forward skips for this slot (LlamaForCausalLM._lora_args)


def clear_lora(model, slot: int) -> None:
    """Zero ``slot``'s columns: a row picking it gets the base model's result."""
    from .hugepages import placement_lock

    mods = _slots(model)
    with placement_lock(), torch.no_grad():
        for mod in mods.values():
            p = mod.pair(slot)
            p.a.zero_()
            p.b.zero_()
    model._native_lora = {}
