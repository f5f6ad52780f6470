"""Drafters that draft from the target's own hidden states: an EAGLE-style feature head and Medusa-style heads.

Both read the target's last hidden state f_i (final norm applied: what ``LlamaForCausalLM.forward`` returns at
position i, whose logits predict token i+1) and reuse the target's embedding and LM head, so they ship only their
own few million weights.

  EagleHead    (Li et al. 2024) one decoder layer over entries e_i = fc([embed(x_{i+1}); f_i]) at position i,
               with its own KV cache (the draft pool): it predicts f_{i+1}, whose logits under the target's head
               give x_{i+2}. Drafting feeds its own predictions back: (f^_{i+1}, x^_{i+2}) -> f^_{i+2} -> ...
  Eagle3Head   (Li et al. 2025, EAGLE-3) the same one-layer shape over a low, a middle and a high layer of the
               target fused (fc of their outputs, ``aux_layers``) instead of its last state, with a head of its own
               over a draft vocabulary; its output is a free hidden state (not a prediction of the target's), fed
               back as the next entry's hidden when drafting, and trained on its own outputs over several steps.
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
from ..sampling import inverse_cdf
from .layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rope
from .llama import Attention, DecoderLayer, LlamaForCausalLM


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
    quantized: str | None = None  # set when an engine quantized the head's projections (model.quant.quantize_linears)
    _target: _TargetView | None = None

    def attach(self, target: LlamaForCausalLM):
        check_target(self, target)
        self._target = _TargetView(target)
        return self

    @property
    def device(self) -> torch.device:
        return self._anchor().device

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor().dtype

    def _anchor(self) -> torch.Tensor:
        """A parameter that moves and casts with the head and that quantization never replaces: the final norm's
        weight where the head has one. ``next(self.parameters())`` walks the module tree at every read, and a draft
        round read the head's device and dtype ~10 times (a Python generator each, run cold after the target's
        weights streamed through the caches)."""
        norm = self._modules.get("norm")
        return norm.weight if norm is not None else next(self.parameters())

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._target.lm_head_weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target.compute_logits(hidden)

    compiled = None  # an EAGLE head's compiled draft steps (model.compile.compile_model), as a target's

    def _dispatch(self, tokens, features, positions, kv, meta, embed, eager=False):
        """An EAGLE head's forward: appending up to ``compiled.max_tokens`` entries to a cache (not a first, causal
        fill: a prompt's, eager as the target's prefill), through the compiled step where one is built (the same
        bits: every reduction an infer kernel, model.compile), else ``_forward``. ``eager``: ``_forward`` always (a
        call of a width no graph may cover, made once: it would compile in the request's step)."""
        self.rotary.reserve(int(positions.max()) if meta is None else meta.kv_len - 1, features.device,
                            features.dtype)
        c = self.compiled
        if c is not None and not eager and kv is not None and embed is None and tokens.shape[1] <= c.max_tokens \
                and not meta.is_causal:
            step = c.steps()[0]
            if step is not None:
                return step(tokens, features, positions, kv, meta)
        return self._forward(tokens, features, positions, kv, meta, embed)

    def draft_chain(self, tokens: torch.Tensor, hidden: torch.Tensor, kv, metas: list, vocab,
                    temperature: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``len(metas)`` draft steps back to back (an EAGLE head's): tokens [n] (each row's last draft), hidden [n, H]
        (the step before's output), temperature [n] (0: greedy), u [n, m] float64 uniforms (each row's next m, from
        its generator; ignored where greedy) -> (the drafts [n, m], the last step's output [n, H], q [n, m, N]).

        Step i appends one entry a row where ``metas[i]`` plans it (``pool.prepare``, called m times beforehand: the
        positions follow one another) and scores its output over ``vocab`` (a DraftVocab, N tokens). A greedy row's
        draft is the argmax; another row draws from q = softmax(logits / T) (plain temperature sampling:
        logits_to_probs without its other stages) with its uniform (sampling.inverse_cdf), and q is the law
        verification judges the draft by (a greedy row's q is not used). The draft feeds step i + 1: the ops of m
        single steps and their draws, so the same drafts. Compiled (one graph per m, every size dynamic: greedy and
        sampled rows, any vocabulary, alike), a draft step then costs its kernels, not Dynamo's call and the host
        work between steps (issue 33's c)."""
        self.rotary.reserve(metas[-1].kv_len - 1, hidden.device, hidden.dtype)
        chain = self._graphs("_chain", vocab)
        if chain is None:
            return self._chain(tokens, hidden, kv, metas, vocab, temperature, u)
        return chain(tokens, hidden, kv, metas, vocab, temperature, u)  # traced without duck shapes (compile.py)

    _vocab_head: tuple = ()  # (the quantized vocabulary head the compiled chains and rounds were traced with,)

    def _graphs(self, name: str, vocab):
        """The compiled ``name`` (a chain or a round) for a call scoring over ``vocab``; None: run it eagerly. A
        quantized vocabulary's head (DraftVocab.quantized) is a module the call reaches through an argument, so on the
        CPU its weights are constants of the graphs (model.compile, _trace_settings), and no guard tells another
        head of the same shapes apart: the graphs serve the first head they meet, and another one (a second engine
        sharing this drafter with another vocabulary) runs eagerly. The same head in every per-prompt vocabulary of an
        engine (``including`` keeps it)."""
        c = self.compiled
        fn = c.method(name) if c is not None else None
        head = getattr(vocab, "head", None)
        if fn is not None and head is not None:
            if not self._vocab_head:
                self._vocab_head = (head,)  # a tuple: a module attribute would register it as a submodule
            elif self._vocab_head[0] is not head:
                return None
        return fn

    def _chain(self, tokens, hidden, kv, metas, vocab, temperature, u):
        return self._steps(tokens, hidden, kv, metas, vocab, temperature, u, [], [])

    def draft_round(self, tokens: torch.Tensor, features: torch.Tensor, last: torch.Tensor, kv, metas: list, vocab,
                    temperature: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A round's first draft step and ``len(metas) - 1`` steps after it in one call (an EAGLE head's): the
        catch-up entries tokens [n, T] and features [n, T, W] (true features, planned by ``metas[0]``; row i's last
        real entry at ``last[i]``), whose last output is scored and drawn from, then the steps of ``draft_chain``
        (``metas[1:]``, u [n, len(metas)]: a uniform per draw) -> (drafts [n, m], the last output [n, H],
        q [n, m, N]). The ops of a catch-up forward, a draw and a chain, so the same drafts; compiled, one call
        instead of three (the first forward's, its eager draw's and the chain's: each call's entry, guards and
        host work are the fixed part of c, issue 33)."""
        self.rotary.reserve(metas[-1].kv_len - 1, features.device, features.dtype)
        fn = self._graphs("_round", vocab)
        if fn is None:
            return self._round(tokens, features, last, kv, metas, vocab, temperature, u)
        return fn(tokens, features, last, kv, metas, vocab, temperature, u)

    def _round(self, tokens, features, last, kv, metas, vocab, temperature, u):
        out = self._forward(tokens, features, metas[0].positions, kv, metas[0])  # [n, T, H]
        hidden = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # [n, H]
        drafts, qs = [], []
        token = self._draw(hidden, vocab, temperature, u[:, 0], drafts, qs)
        return self._steps(token, hidden, kv, metas[1:], vocab, temperature, u[:, 1:], drafts, qs)

    def _steps(self, tokens, hidden, kv, metas, vocab, temperature, u, drafts, qs):
        for i, meta in enumerate(metas):
            hidden = self._forward(tokens[:, None], hidden[:, None], meta.positions, kv, meta)[:, 0]
            tokens = self._draw(hidden, vocab, temperature, u[:, i], drafts, qs)
        return torch.stack(drafts, 1), hidden, torch.stack(qs, 1)

    @staticmethod
    def _draw(hidden, vocab, temperature, u, drafts, qs):
        """Score hidden [n, H] over ``vocab`` and draw: the argmax (sampling.argmax, the first maximum) where
        temperature is 0, else inverse_cdf of q = softmax(logits / T) at u [n]; the draft and q appended."""
        logits = vocab.logits(hidden)  # float32 [n, N]
        sampled = temperature > 0
        q = (logits / torch.where(sampled, temperature, 1.0)[:, None]).softmax(-1)
        token = vocab.token(torch.where(sampled, inverse_cdf(q, u), logits.max(-1).indices))
        drafts.append(token)
        qs.append(q)
        return token


class EagleHead(DraftHead):
    kind = "eagle"
    has_kv = True  # one layer's KV in the draft pool
    # its entry at position i reads token x_{i+1} (fc([embed(x_{i+1}); f_i])): a block of its cache depends on one
    # token past the block, which the KV manager's prefix-cache keys for the draft pool take in (kv_manager)
    entry_shift = 1

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
                embed: nn.Embedding | None = None, eager: bool = False) -> torch.Tensor:
        """tokens [B, T] (x_{i+1}), features [B, T, H] (f_i), positions [B, T] (i) -> f^_{i+1} [B, T, H].

        ``kv=None``: plain causal attention over the T entries (training). ``eager``: never a compiled step."""
        return self._dispatch(tokens, features, positions, kv, meta, embed, eager)

    def _forward(self, tokens, features, positions, kv, meta, embed=None) -> torch.Tensor:
        embed = embed if embed is not None else self._target.target.embed_tokens
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], -1))
        cos, sin = self.rotary(positions)
        return self.norm(self.layer(x, cos, sin, kv, meta))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads [norm(embedding); norm(hidden)] (2H wide), the residual stream is
    the hidden alone."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token's embedding
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the hidden (fused target layers, or the last output)
        self.self_attn = Attention(cfg, 0, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = GatedMLP(H, cfg.intermediate_size, cfg.mlp_bias)

    def attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)

    def forward(self, emb, hidden, cos, sin, kv, meta):
        h = hidden + self.self_attn(self.attn_input(emb, hidden), cos, sin, kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DraftHead):
    kind = "eagle3"
    has_kv = True  # one layer's KV in the draft pool
    # its entry at position i reads token x_{i+1} (fc([embed(x_{i+1}); f_i])): a block of its cache depends on one
    # token past the block, which the KV manager's prefix-cache keys for the draft pool take in (kv_manager)
    entry_shift = 1
    hidden_input = True  # the proposer feeds each draft entry the previous step's output (EagleProposer)
    # ``native_round``'s screen of the vocabulary head (kernels/eagle_round.cpp): its rows in Q4_0, the best
    # ``screen_top`` rescored by the head's own; 0: the head's own rows alone. Set before native_round_ready first runs.
    screen_top = 8

    def __init__(self, target_config: ModelConfig, aux_layers: tuple[int, ...], draft_ids: list[int],
                 intermediate_size: int | None = None):
        super().__init__()
        if len(aux_layers) < 1 or any(not 0 <= i < target_config.num_hidden_layers for i in aux_layers):
            raise ValueError(f"aux_layers {aux_layers} must be layers of the target (0..."
                             f"{target_config.num_hidden_layers - 1})")
        ids = sorted(set(int(i) for i in draft_ids))
        if not ids or ids[0] < 0 or ids[-1] >= target_config.vocab_size:
            raise ValueError(f"draft_ids must be token ids in [0, {target_config.vocab_size})")
        self.config = replace(target_config, num_hidden_layers=1,
                              intermediate_size=intermediate_size or target_config.intermediate_size)
        H = self.config.hidden_size
        self.aux_layers = tuple(aux_layers)
        self.fc = Linear(len(aux_layers) * H, H, bias=False)
        self.layer = Eagle3Layer(self.config)
        self.norm = RMSNorm(H, self.config.rms_norm_eps)
        self.lm_head = Linear(H, len(ids), bias=False)  # its own head over the draft vocabulary
        self.register_buffer("draft_ids", torch.tensor(ids, dtype=torch.long))  # [N] ascending: column j's token
        self.rotary = RotaryEmbedding(self.config.head_dim, self.config.rope)

    def attach(self, target: LlamaForCausalLM):
        super().attach(target)
        target.capture_layers(self.aux_layers)  # the target's forward now returns these layers too
        return self

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads: its captured layers (what follows the final state)."""
        return len(self.aux_layers) * self.config.hidden_size

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv=None, meta=None,
                embed: nn.Embedding | None = None, eager: bool = False) -> torch.Tensor:
        """tokens [B, T] (x_{i+1}); hidden [B, T, n H]: the target's captured layers at i (fused by fc), or [B, T, H]:
        the head's own output of the step before; positions [B, T] (i) -> the output [B, T, H] (``draft_logits``
        scores it; the next draft step reads it as its hidden). ``kv=None``: causal attention over the T entries."""
        return self._dispatch(tokens, hidden, positions, kv, meta, embed, eager)

    def _forward(self, tokens, hidden, positions, kv, meta, embed=None) -> torch.Tensor:
        embed = embed if embed is not None else self._target.target.embed_tokens
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        cos, sin = self.rotary(positions)
        return self.layer(embed(tokens).to(hidden.dtype), hidden, cos, sin, kv, meta)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] -> float32 logits [..., N] over the draft vocabulary (column j is token draft_ids[j])."""
        return self.lm_head(self.norm(out)).float()

    _native: tuple | None = None  # (the op's weight arguments,) once checked; () where the op cannot run the head

    def native_round_ready(self) -> bool:
        """Whether ``native_round`` runs this head: on the CPU with infer's kernels, bfloat16, and every projection in
        llama.cpp's blocks without a bias (a head quantized to a block type: EngineConfig.draft_quantization's
        default on a quantized target). Checked once (an engine quantizes its drafter before its first round)."""
        if self._native is None:
            from .. import kernels
            from .quant import BlockLinear

            attn, mlp = self.layer.self_attn, self.layer.mlp
            lins = [self.fc, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, self.lm_head]
            norms = [self.layer.input_layernorm, self.layer.hidden_norm, self.layer.post_attention_layernorm, self.norm]
            ok = (self.device.type == "cpu" and self.dtype == torch.bfloat16 and kernels.available()
                  and all(isinstance(m, BlockLinear) and m.bias is None for m in lins)
                  and len({n.eps for n in norms}) == 1)
            self._native = ((tuple(m.packed for m in lins), [m.format_id for m in lins],
                             [m.out_features for m in lins], tuple(n.weight for n in norms), norms[0].eps,
                             self._screen(self.lm_head)),) if ok else ()
        return bool(self._native)

    def _screen(self, head) -> torch.Tensor | None:
        """The vocabulary head's rows in Q4_0 (packed), for ``native_round``'s screen; None where there is none to
        make: ``screen_top`` 0, a vocabulary of few more rows than it rescores, or a head in Q4_0 already."""
        from .quant import pack_blocks, quantize_blocks

        if self.screen_top <= 0 or head.fmt == "q4_0" or head.out_features < 4 * self.screen_top:
            return None
        return pack_blocks(quantize_blocks(head.dequantized_weight().float(), "q4_0"), "q4_0")

    def native_round(self, tokens: torch.Tensor, features: torch.Tensor, pool, slot: int, start: int,
                     temperature: torch.Tensor, u: torch.Tensor,
                     stop: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """``draft_round`` for one row in one C++ call (kernels/eagle_round.cpp, where ``native_round_ready``): the
        catch-up entries tokens [T] and features [T, W] at positions start .. start + T - 1 of ``slot`` in a paged
        ``pool`` (which holds the row's blocks and length for them and the u.shape[1] - 1 steps after them:
        PagedKVCachePool.extend), then those steps -> (drafts [1, S], the last output [1, H], q [1, S, N], each
        draft's probability under q [1, S]), the same ops as draft_round's, so the same drafts. A round's drafting
        was a compiled graph entered cold after every verify: ~1.8 ms for 3 drafts, of which the kernels' own work was
        ~0.75 (issue 33's c).

        With a screen (``screen_top`` > 0, and a vocabulary head in Q8_0 of >= 4 x that many rows), each step scores
        the draft vocabulary with the head's rows in Q4_0 and rescores the best ``screen_top`` with its own: ~half a
        step's largest product's bytes. Greedy drafts are the head's own argmax wherever it is among the screen's
        best; a sampled draft is drawn from the screen's law, which q reports (lossless: the verify judges by q).
        SmolLM2's head, 3 drafts in a loop: 0.614 -> 0.540 ms (docs/benchmarks.md).

        ``stop`` = (acceptance by confidence bin [bins], below [>= S - 1], float32): the round ends before step j + 1
        where the chance that drafts 1 .. j are all accepted (the product of their bins' acceptance) is under
        below[j - 1], returning the S' <= S drafts drawn (kernels/eagle_round.cpp; EagleProposer's rounds under auto
        K). The drafts it returns are the first S' of the round without a stop, the same bits."""
        (packed, formats, outs, norms, eps, screen), = self._native
        S = u.shape[1]
        self.rotary.reserve(start + tokens.shape[0] + S - 2, features.device, features.dtype)
        k, v = pool.k[0], pool.v[0]
        return torch.ops.infer.eagle3_round(
            tokens, features, packed, formats, outs, norms, eps, self._target.target.embed_tokens.weight,
            self.draft_ids, self.rotary._cos, self.rotary._sin, k, v, pool.block_table(slot), pool.block_size, start,
            self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim, temperature, u,
            screen, self.screen_top if screen is not None else 0, *(stop if stop is not None else (None, None)))

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int, select: torch.Tensor | None = None,
               embed: nn.Embedding | None = None) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Training-time test (EAGLE-3): the outputs drafting would compute over ``steps`` draft steps, teacher
        forced on the sequence (each step's token is the true next one, which is what an accepted draft is).

        tokens [B, T] (x_0 .. x_{T-1}), aux [B, T, n H] (the target's captured layers at each position).
        Step 0: entry i = (x_{i+1}, fc(aux_i)) at position i, i = 0 .. T-2, causal over the entries -> o_0 [B, T-1, H]
        (o_0[i] predicts x_{i+2}). Step s >= 1, only for the entries ``select`` [M, 2] (row, i) (default: every
        (b, i) with i + steps <= T - 1): entry (x_{i+1+s}, o_{s-1}[i]) at position i + s, attending to step 0's
        entries 0 .. i and to its own column's entries of steps 1 .. s, as a draft step attends to the cache
        (true entries, then the drafts before it) -> o_s [M, H] (predicts x_{i+2+s}).
        Returns (o_0, [o_1 .. o_{steps-1}], select)."""
        embed = embed if embed is not None else self._target.target.embed_tokens
        attn, layer = self.layer.self_attn, self.layer
        B, T = tokens.shape
        nh, nkv, D = attn.n_heads, attn.n_kv, attn.head_dim
        self.rotary.reserve(T + steps, aux.device, aux.dtype)

        def qkv_of(emb, hidden, pos):  # -> q [.., nh, D], k, v [.., nkv, D] (rotated at pos)
            qkv = attn.qkv_proj(layer.attn_input(emb, hidden))
            cos, sin = self.rotary(pos)
            qk = apply_rope(qkv[..., : (nh + nkv) * D].unflatten(-1, (nh + nkv, D)), cos, sin)
            return qk[..., :nh, :], qk[..., nh:, :], qkv[..., (nh + nkv) * D:].unflatten(-1, (nkv, D))

        def finish(hidden, o):  # residual + MLP after attention output o [.., nh * D]
            h = hidden + attn.o_proj(o)
            return h + layer.mlp(layer.post_attention_layernorm(h))

        hid0 = self.fc(aux[:, :-1])
        q0, k0, v0 = qkv_of(embed(tokens[:, 1:]).to(aux.dtype), hid0, torch.arange(T - 1, device=aux.device)[None])
        o = torch.nn.functional.scaled_dot_product_attention(q0.transpose(1, 2), k0.transpose(1, 2),
                                                             v0.transpose(1, 2), is_causal=True,
                                                             enable_gqa=nkv != nh)  # [B, nh, T-1, D]
        out0 = finish(hid0, o.transpose(1, 2).flatten(-2))
        if select is None:
            i = torch.arange(T - steps, device=aux.device)
            select = torch.stack([torch.arange(B, device=aux.device).repeat_interleave(len(i)), i.repeat(B)], 1)
        rows, cols = select[:, 0], select[:, 1]
        kg = k0.repeat_interleave(nh // nkv, 2) if nkv != nh else k0  # [B, T-1, nh, D]
        vg = v0.repeat_interleave(nh // nkv, 2) if nkv != nh else v0
        scale = D ** -0.5
        outs, diag_k, diag_v, hidden = [], [], [], out0[rows, cols]  # [M, H]
        # step 0's entries after a column are not visible to it: [M, 1, T-1]
        later = torch.arange(T - 1, device=aux.device)[None, None, :] > cols[:, None, None]
        for s in range(1, steps):
            q, k, v = qkv_of(embed(tokens[rows, cols + 1 + s])[:, None].to(aux.dtype), hidden[:, None],
                             (cols + s)[:, None])
            q, k, v = q[:, 0], k[:, 0], v[:, 0]  # [M, nh or nkv, D]
            diag_k.append(k.repeat_interleave(nh // nkv, 1) if nkv != nh else k)
            diag_v.append(v.repeat_interleave(nh // nkv, 1) if nkv != nh else v)
            sc0 = (_scores_by_row(q, kg, rows, cols) * scale).masked_fill(later, float("-inf"))  # [M, nh, T-1]
            scd = torch.stack([(q * kk).sum(-1) for kk in diag_k], -1) * scale  # [M, nh, s]
            w = torch.cat([sc0, scd], -1).softmax(-1)
            o = _mix_by_row(w[..., : T - 1], vg, rows, cols) + (w[..., T - 1:, None] * torch.stack(diag_v, 2)).sum(2)
            hidden = finish(hidden, o.flatten(-2))
            outs.append(hidden)
        return out0, outs, select


def _scores_by_row(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """q [M, h, D], entry m at (rows[m], cols[m]) (distinct), against the keys of its own batch row, k [B, T, h, D]
    -> [M, h, T]. One batched product over a [B, T] grid of the queries (zeros where no entry sits, never read): a
    loop over the batch rows cost a mask, a host sync and ~8 kernels a row, and made a GPU's training step
    launch-bound (scripts/eagle3_gpu.py); the grid costs B x T x h x T floats, ~0.3 GB at 32 x 512 x 9."""
    B, T = k.shape[:2]
    grid = q.new_zeros(B, T, *q.shape[1:]).index_put((rows, cols), q)  # [B, T, h, D]
    return torch.einsum("bihd,bthd->biht", grid, k)[rows, cols]


def _mix_by_row(w: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """weights w [M, h, T] of entry m at (rows[m], cols[m]) over the values of its own row, v [B, T, h, D] -> [M, h, D]
    (the grid of ``_scores_by_row``)."""
    B, T = v.shape[:2]
    grid = w.new_zeros(B, T, *w.shape[1:]).index_put((rows, cols), w)  # [B, T, h, T]
    return torch.einsum("biht,bthd->bihd", grid, v)[rows, cols]


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
    if isinstance(head, (EagleHead, Eagle3Head)) and (c.num_attention_heads, c.num_key_value_heads, c.head_dim) != (
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
    if isinstance(head, Eagle3Head):
        shape.update(aux_layers=list(head.aux_layers), draft_vocab_size=len(head.draft_ids))
    body = {"infer_drafter": {"kind": head.kind, **shape, **(extra or {})}}
    (out / "config.json").write_text(json.dumps(body, indent=1) + "\n")
    save_file({k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in head.state_dict().items()}, str(out / "model.safetensors"))
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
    state = load_file(str(root / "model.safetensors"))
    if kind == "eagle":
        head = EagleHead(cfg, spec["intermediate_size"])
    elif kind == "eagle3":
        if "draft_ids" not in state:
            raise ValueError(f"{root / 'model.safetensors'} lacks draft_ids: not an eagle3 head")
        head = Eagle3Head(replace(cfg, num_hidden_layers=t.num_hidden_layers), tuple(spec["aux_layers"]),
                          state["draft_ids"].tolist(), spec["intermediate_size"])
    else:
        head = MedusaHeads(cfg, spec["num_heads"], spec.get("num_layers", 1))
    check_target(head, target)
    missing = set(head.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{root / 'model.safetensors'} lacks {sorted(missing)[:3]}: not a {kind} head")
    head.load_state_dict({k: v for k, v in state.items() if k in head.state_dict()}, strict=False)
    return head.to(device=target.device, dtype=target.dtype).eval().attach(target)  # .to keeps integer buffers
