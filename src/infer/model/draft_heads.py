"""Drafters that draft from the target's own hidden states: an EAGLE-style feature head and Medusa-style heads.

Both read the target's last hidden state f_i (final norm applied: what ``LlamaForCausalLM.forward`` returns at
position i, whose logits predict token i+1) and reuse the target's embedding and LM head, so they ship only their
own few million weights.

  EagleHead    (Li et al. 2024) one decoder layer over entries e_i = fc([embed(x_{i+1}); f_i]) at position i,
               with its own KV cache (the draft pool): it predicts f_{i+1}, whose logits under the target's head
               give x_{i+2}. Drafting feeds its own predictions back: (f^_{i+1}, x^_{i+2}) -> f^_{i+2} -> ...
  MedusaHeads  (Cai et al. 2024; Stern et al. 2018's blockwise parallel decoding) head k (k = 1..K) maps f_i
               through a residual SiLU block to the state whose logits predict x_{i+1+k}: K drafts from one state
               and no cache. The heads' chain (each head's top-1) is the proposal; trees come later.

A shipped head is a directory: ``config.json`` (``"infer_drafter": {"kind": "eagle" | "medusa", ...}``, with the
shape and the target's hidden size), ``model.safetensors`` and usually ``draft_vocab.json`` (the draft vocabulary).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import ModelConfig
from .layers import Linear, RMSNorm, RotaryEmbedding
from .llama import DecoderLayer, LlamaForCausalLM


class _TargetView:
    """What a head borrows from its target without owning (or saving) it: embedding and LM head."""

    def __init__(self, target: LlamaForCausalLM):
        self.target = target

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target.lm_head_weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> float32 [..., V] under the target's LM head (the full vocabulary)."""
        return self.target._logits(hidden)


class DraftHead(nn.Module):
    """What both heads share: a borrowed target (embedding, LM head) and its dtype / device."""

    kind = "?"
    has_kv = False  # True: the KV manager keeps a draft pool for the head, in lockstep with the target's
    _target: _TargetView | None = None

    def attach(self, target: LlamaForCausalLM):
        check_target(self, target)
        self._target = _TargetView(target)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._target.lm_head_weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target.compute_logits(hidden)


class EagleHead(DraftHead):
    kind = "eagle"
    has_kv = True  # one layer's KV in the draft pool

    def __init__(self, target_config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        # the layer has the target's attention shape, so the draft pool is sized like one target layer
        self.config = replace(target_config, num_hidden_layers=1,
                              intermediate_size=intermediate_size or target_config.intermediate_size)
        H = self.config.hidden_size
        self.fc = Linear(2 * H, H, bias=True)
        self.layer = DecoderLayer(self.config, 0)
        self.norm = RMSNorm(H, self.config.rms_norm_eps)  # f^ lives where the target's final-norm states live
        self.rotary = RotaryEmbedding(self.config.head_dim, self.config.rope)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, kv=None, meta=None,
                embed: nn.Embedding | None = None) -> torch.Tensor:
        """tokens [B, T] (x_{i+1}), features [B, T, H] (f_i), positions [B, T] (i) -> f^_{i+1} [B, T, H].

        ``kv=None``: plain causal attention over the T entries (training)."""
        embed = embed if embed is not None else self._target.target.embed_tokens
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], -1))
        self.rotary.reserve(int(positions.max()) if meta is None else meta.kv_len - 1, x.device, x.dtype)
        cos, sin = self.rotary(positions)
        return self.norm(self.layer(x, cos, sin, kv, meta))


class ResBlock(nn.Module):
    """h + SiLU(W h + b), W starting at zero: a fresh head starts as the target's own next-token head."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = Linear(hidden, hidden, bias=True)
        nn.init.zeros_(self.linear.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.nn.functional.silu(self.linear(h))


class MedusaHeads(DraftHead):
    kind = "medusa"

    def __init__(self, target_config: ModelConfig, num_heads: int = 4, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"Medusa needs at least one head of one layer, got {num_heads} x {num_layers}")
        self.config = replace(target_config, num_hidden_layers=1)
        H = self.config.hidden_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(H) for _ in range(num_layers)]) for _ in range(num_heads))

    def forward(self, features: torch.Tensor, k: int) -> torch.Tensor:
        """f_i [..., H] -> the state whose logits predict x_{i+1+k} (k = 1 .. num_heads)."""
        return self.heads[k - 1](features)


def check_target(head, target: LlamaForCausalLM) -> None:
    c, t = head.config, target.config
    if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
        raise ValueError(f"this {head.kind} head was trained for a target of hidden size {c.hidden_size} and "
                         f"vocabulary {c.vocab_size}; the target has {t.hidden_size} and {t.vocab_size}")
    if isinstance(head, EagleHead) and (c.num_attention_heads, c.num_key_value_heads, c.head_dim) != (
            t.num_attention_heads, t.num_key_value_heads, t.head_dim):
        raise ValueError("this eagle head's attention shape differs from the target's")


def save_heads(head: DraftHead, out_dir: str | os.PathLike, dtype=torch.bfloat16,
               extra: dict | None = None) -> Path:
    """config.json + model.safetensors (the head's own weights only, never the target's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = head.config
    shape = {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "head_dim": c.head_dim}
    if isinstance(head, MedusaHeads):
        shape.update(num_heads=head.num_heads, num_layers=head.num_layers)
    body = {"infer_drafter": {"kind": head.kind, **shape, **(extra or {})}}
    (out / "config.json").write_text(json.dumps(body, indent=1) + "\n")
    save_file({k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()},
              str(out / "model.safetensors"))
    return out


def load_heads(path: str | os.PathLike, target: LlamaForCausalLM) -> DraftHead:
    """A shipped head, attached to ``target`` and in its dtype and device; a ValueError names a mismatch."""
    root = Path(path)
    spec = json.loads((root / "config.json").read_text())["infer_drafter"]
    kind = spec["kind"]
    t = target.config
    cfg = replace(t, hidden_size=spec["hidden_size"], vocab_size=spec["vocab_size"],
                  num_attention_heads=spec.get("num_attention_heads", t.num_attention_heads),
                  num_key_value_heads=spec.get("num_key_value_heads", t.num_key_value_heads),
                  head_dim=spec.get("head_dim", t.head_dim))
    if kind == "eagle":
        head = EagleHead(cfg, spec["intermediate_size"])
    else:
        head = MedusaHeads(cfg, spec["num_heads"], spec.get("num_layers", 1))
    check_target(head, target)
    state = load_file(str(root / "model.safetensors"))
    missing = set(head.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{root / 'model.safetensors'} lacks {sorted(missing)[:3]}: not a {kind} head")
    head.load_state_dict({k: v for k, v in state.items() if k in head.state_dict()}, strict=False)
    return head.to(device=target.device, dtype=target.dtype).eval().attach(target)
