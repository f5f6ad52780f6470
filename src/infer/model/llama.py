"""Our LlamaForCausalLM: a plain nn.Module driven by the checkpoint's config.

    hidden = model(input_ids, positions, kv, attn_meta)   # [B, T, hidden], final norm applied
    logits = model.compute_logits(hidden[:, idx])         # float32, only for the positions a caller needs

The model knows nothing of scheduling or speculation: the KV pool (``kv``) and the per-forward plan
(``attn_meta``, built by ``kv.prepare``) tell it where keys go and which ones each query may see. With
``kv=None`` it runs plain causal attention over the given tokens (training, reference checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import kernels
from ..cache.base import AttnMeta, KVCachePool
from ..cache.paged import PagedKVCachePool
from ..config import ModelConfig
from .layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, kernels_take, linear, project, rope_heads, sdpa
from .lora import LoRALinear
from .quant import BlockLinear

if TYPE_CHECKING:
    from .compile import CompiledSteps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, in_features: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # q, k and v are one fused matmul; the loader concatenates the checkpoint's three weights. ``in_features``:
        # an EAGLE-3 head's layer reads [embedding; hidden] (model.draft_heads)
        self.qkv_proj = Linear(in_features or cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, kv: KVCachePool | None, meta: AttnMeta | None):
        B, T, _ = x.shape
        lens = meta.lens if meta is not None else None  # [B] real tokens a row: the pads past them are skipped
        adapters = meta.adapters if meta is not None else None  # [B] each row's LoRA adapter (per-request ones)
        qkv = project(self.qkv_proj, x, lens, adapters)
        # Rotate q and k together: they share cos/sin per position. [B, T, H + Hkv, D]
        qk = rope_heads(qkv, cos, sin, self.n_heads + self.n_kv, self.head_dim, lens)
        q = qk[:, :, : self.n_heads].transpose(1, 2)  # [B, H, T, D]
        k = qk[:, :, self.n_heads:].transpose(1, 2)  # [B, Hkv, T, D]
        v = qkv[..., self.q_size + self.kv_size:].view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        # every CPU step over the cache (decode, verify, prefill): infer's kernel, batch-invariant, so a token's
        # output is the same whichever step computes it. A decode step of 32 rows is 32 independent few-token
        # queries, which ATen's SDPA with a padding mask ran at ~7 ms a layer (its general path) and the kernel at a
        # fraction of that; a prefill's causal queries, in groups sharing each key's load, at ~1/3 of ATen's flash
        # attention (46 tokens) to 2/3 (330). It reads a paged pool's blocks where they lie (``rows``: each key's
        # storage row) rather than a gathered copy. Without a cache (training, references): ATen's.
        kernel = kernels_take(x)
        if kv is None:
            mask, causal, rows = None, T > 1, None
        elif kernel:
            k, v, rows = kv.update_in_place(self.layer_idx, k, v, meta)
            mask, causal = meta.kernel_mask(), False
        else:
            k, v = kv.update(self.layer_idx, k, v, meta)  # [B, Hkv, kv_len, D]
            mask, causal, rows = meta.mask, meta.is_causal, None
        if kernel and not causal:
            o = torch.ops.infer.attention(q, k, v, mask, rows, lens)
        else:
            o = sdpa(q, k, v, mask, causal, self.n_kv != self.n_heads)
        return project(self.o_proj, o.transpose(1, 2).reshape(B, T, self.q_size), lens, adapters)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, kv, meta):
        lens = meta.lens if meta is not None else None  # [B] real tokens a row: the kernels skip the pads past them
        x = x + self.self_attn(self.input_layernorm(x, lens), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x, lens), lens, meta.adapters if meta is not None else None)


def _zero_pads(logits: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] with the pads' rows (positions >= lens[b]), which the kernels leave unwritten, set to 0: finite
    for a round's batched verification. After the head (compiled on CUDA), and only where a row has pads (asked on the
    host): inside a compiled head, the fill's data-dependent ``nonzero`` split its graph in two on every verify (two
    graph calls and Dynamo's entry twice, ~0.15 ms), pads or not. The pads' rows alone are written (a pass over every
    row cost ~2.5 ms at 8 x 9 x 49,152)."""
    T = logits.shape[-2]
    if int(lens.min()) >= T:
        return logits
    pads = (torch.arange(T, device=lens.device) >= lens[:, None]).view(-1).nonzero().view(-1)
    logits.view(-1, logits.shape[-1]).index_fill_(0, pads.to(logits.device), 0)
    return logits


class LlamaForCausalLM(nn.Module):
    # A lone row's few-token step over a paged pool (decode, verify, a K = 0 step, a short prefill chunk) of a
    # bfloat16 model whose products are all llama.cpp blocks runs as one C++ call (kernels/lm_round.cpp,
    # infer::llama_forward): the same kernels in the same order as ``_forward``, so the same bits, without a compiled
    # graph's entry, the dispatcher's ~12 calls a layer and the graph's pointwise code (~2.3 of a ~10 ms SmolLM2 decode
    # step, docs/benchmarks.md). False: every step through ``_forward`` (compiled where it is), for A/B.
    native = True

    def __init__(self, cfg: ModelConfig, init_embedding: bool = True):
        super().__init__()
        self.config = cfg
        # init_embedding=False: left uninitialised, for a loader that assigns the weights next. nn.Embedding's random
        # init goes through a function that imports Dynamo (~1 s of a start that may never compile).
        empty = None if init_embedding else torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        if cfg.tie_word_embeddings:
            self.lm_head = None  # compute_logits reuses embed_tokens.weight
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.quantization: str | None = None  # set by infer.model.quant.quantize_model
        # Layers whose outputs the forward also returns, after the final state (``capture_layers``): an EAGLE-3
        # drafter reads a low, a middle and a high layer of the target
        self.aux_layers: tuple[int, ...] = ()
        self.source_blocks = None  # GGUF loads: module name -> the file's quantized rows (loader.load_model)
        self.lora_adapters = 0  # how many LoRA adapters each request picks from (model.lora.apply_loras)
        self.lora_rank = 0  # columns per adapted part of a slot for adapters loaded at run time (lora.reserve_loras)
        # Set by infer.model.compile.compile_model: compiled twins of _forward / _logits for few-token steps.
        self.compiled: CompiledSteps | None = None
        self._native_key: tuple | None = None  # what _native_stack's answer was checked for
        self._native_args: tuple = ()  # infer::llama_forward's weight arguments; () where it cannot run the model
        self._native_lora: dict[int, tuple] = {}  # its LoRA arguments per adapter a row picks (_lora_args)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]; default 0..T-1 (only without a cache)
        kv: KVCachePool | None = None,
        attn_meta: AttnMeta | None = None,
    ) -> torch.Tensor:
        if kv is not None and attn_meta is None:
            raise ValueError("a KV cache needs the attn_meta that kv.prepare() returns")
        if positions is None:
            if kv is not None:
                raise ValueError("positions are required with a KV cache")
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        max_pos = attn_meta.kv_len - 1 if attn_meta is not None else input_ids.shape[1] - 1
        self.rotary.reserve(max_pos, input_ids.device, self.dtype)
        if self.native and kv is not None and input_ids.shape[0] == 1 and input_ids.shape[1] <= kernels.MAX_ROWS \
                and not attn_meta.tree and isinstance(kv, PagedKVCachePool) and self._native_stack(kv):
            rows = torch.arange(attn_meta.row0, attn_meta.row0 + attn_meta.kv_len) if attn_meta.row0 is not None \
                else attn_meta.read_pos[0]
            adapter = int(attn_meta.adapters[0]) if attn_meta.adapters is not None else 0
            return self._native_forward(input_ids, kv, rows, attn_meta.start[0], adapter)
        c = self.compiled
        # decode and verify steps (appending to a cache) run compiled; a prompt's prefill, however short, stays eager
        if c is not None and kv is not None and input_ids.shape[1] <= c.max_tokens and not attn_meta.is_causal:
            step = c.steps()[0]  # None: the compiler is not loaded yet (CompiledSteps), eager meanwhile
            if step is not None:
                return step(input_ids, positions, kv, attn_meta)
        return self._forward(input_ids, positions, kv, attn_meta)

    def runs_natively(self, kv) -> bool:
        """Whether a lone chain row's steps of up to kernels.MAX_ROWS tokens over ``kv`` go through the one-call
        forward (``forward`` takes it there): no compiled graph is needed for them."""
        return self.native and isinstance(kv, PagedKVCachePool) and self._native_stack(kv)

    def _native_stack(self, kv: PagedKVCachePool) -> bool:
        """Whether infer::llama_forward runs this model over ``kv``: on the CPU with infer's kernels, bfloat16 weights
        and cache, every layer's four products llama.cpp blocks without a bias (BlockLinear; under a LoRA adapter's
        LoRALinear, whose A and B the op takes beside them), one norm epsilon.
        Checked again only when what it depends on changes: quantization, dtype, device, the embedding module, and
        the move onto huge pages (model.hugepages replaces every buffer, then sets ``_on_hugepages``). Walking the
        layers to check their buffers every step cost ~0.65 ms of Python a step (30 layers)."""
        key = (self.quantization, self.dtype, self.device, id(self.embed_tokens),
               getattr(self, "_on_hugepages", False))
        if key != self._native_key:
            adapted = self._products()
            lins = [x.base if isinstance(x, LoRALinear) else x for x in adapted]  # a LoRA's delta: passed apart
            norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] \
                + [self.norm]
            ok = (self.device.type == "cpu" and self.dtype == torch.bfloat16 and kernels.available()
                  and isinstance(self.embed_tokens, nn.Embedding)
                  and all(isinstance(x, BlockLinear) and x.bias is None for x in lins)
                  and all(isinstance(n, RMSNorm) for n in norms) and len({n.eps for n in norms}) == 1)
            self._native_args = ((tuple(x.packed for x in lins), [x.format_id for x in lins],
                                  [x.out_features for x in lins], tuple(n.weight for n in norms), norms[0].eps),) \
                if ok else ()
            self._native_lora = {}
            self._native_key = key
        return bool(self._native_args) and kv.k[0].dtype == torch.bfloat16

    def _products(self) -> list[nn.Module]:
        """Each layer's four products in the one-call forward's order (qkv, o, gate/up, down), LoRA-wrapped or not."""
        return [x for layer in self.layers for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    def _lora_args(self, adapter: int) -> tuple[torch.Tensor, ...]:
        """infer::llama_forward's ``lora`` for a row of ``adapter`` (0: none): each product's A and B for that row
        (LoRALinear.pair: its own adapter's alone, as the batched path's other pairs add exactly 0), both empty where
        it adds nothing, or nothing where no product adds anything for this row."""
        if adapter not in self._native_lora:
            none = torch.empty(0, dtype=self.dtype)
            pairs = [x.pair(adapter) if isinstance(x, LoRALinear) and (adapter or not x.per_request) else None
                     for x in self._products()]
            # a pair whose B is all zero adds exactly 0 in the batched path too: skipped (an empty slot)
            pairs = [p if p is not None and bool(p.b.any()) else None for p in pairs]
            args = tuple(t for p in pairs for t in ((p.a, p.b) if p is not None else (none, none)))
            self._native_lora[adapter] = args if any(p is not None for p in pairs) else ()
        return self._native_lora[adapter]

    def _native_forward(self, input_ids, kv: PagedKVCachePool, rows: torch.Tensor, start: int,
                        adapter: int = 0) -> torch.Tensor:
        """``_forward``'s result for a lone chain row through infer::llama_forward: input_ids [1, T] at positions
        start .. start + T - 1, every key read from its storage row (rows [start + T]: consecutive blocks' range, else
        the block table's rows); ``adapter``: the row's LoRA adapter where each request picks its own."""
        (packed, formats, outs, norms, eps), = self._native_args
        lora = self._lora_args(adapter)
        c = self.config
        return torch.ops.infer.llama_forward(
            input_ids[0], packed, formats, outs, norms, eps, self.embed_tokens.weight, self.rotary._cos,
            self.rotary._sin, kv.k, kv.v, rows, start, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, list(self.aux_layers), lora)

    def native_step(self, tokens: list[int], kv: PagedKVCachePool, slot: int, adapter: int = 0) -> torch.Tensor:
        """``forward`` of one chain row, ``tokens`` appended to ``slot`` of ``kv`` (where ``runs_natively(kv)``, at most
        kernels.MAX_ROWS tokens) -> hidden [1, T, H'], through infer::llama_forward as ``forward`` takes it, without
        the plan ``kv.prepare`` builds for the other paths (rotary positions, a [T, keys] mask, the pads' lengths),
        which the kernel never reads: a verify's plan was ~50 us of host work a round."""
        start = kv.extend(slot, len(tokens))
        end = start + len(tokens)
        self.rotary.reserve(end - 1, self.device, self.dtype)
        return self._native_forward(torch.tensor([tokens]), kv, kv.storage_rows(slot, end), start, adapter)

    def _forward(self, input_ids, positions, kv, attn_meta) -> torch.Tensor:
        """The network itself (checked inputs, rotary tables reserved): what torch.compile traces."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        aux = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv, attn_meta)
            if i in self.aux_layers:
                aux.append(x)
        lens = attn_meta.lens if attn_meta is not None else None
        return torch.cat([self.norm(x, lens), *aux], -1) if aux else self.norm(x, lens)

    def capture_layers(self, layers: tuple[int, ...]) -> None:
        """Make the forward return ``[final state; outputs of layers...]`` ``[B, T, (1 + n) H]`` (compute_logits reads
        the first H). A compiled model's graphs are guarded on this (compile.step_guards): setting it recompiles."""
        bad = [i for i in layers if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"layers {bad} do not exist: the model has {self.config.num_hidden_layers}")
        self.aux_layers = tuple(sorted(set(layers)))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection ``[vocab, hidden]`` (the embedding itself when tied; dequantized if quantized)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return self.lm_head.dequantized_weight() if hasattr(self.lm_head, "dequantized_weight") else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        """hidden ``[..., hidden]`` (or what ``forward`` returns with captured layers) -> float32 logits
        ``[..., vocab]``. ``lens`` ([B], hidden ``[B, T, ...]``): row b's positions from lens[b] on are pads, which
        the CPU kernels skip (their logits 0; a verify of rows with fewer drafts than the longest: ``attn_meta.lens``)."""
        c = self.compiled
        if c is not None and c.has_logits and hidden.numel() <= c.max_tokens * hidden.shape[-1] \
                and (step := c.steps()[1]) is not None:
            logits = step(hidden) if lens is None else step(hidden, lens)
        else:
            logits = self._logits(hidden, lens)
        return logits if lens is None else _zero_pads(logits, lens)

    def _logits(self, hidden: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        """The head (what torch.compile traces); the pads' rows are left as the kernels leave them (``_zero_pads``)."""
        hidden = hidden[..., : self.config.hidden_size]  # the final state (layers captured for a drafter follow it)
        if isinstance(self.lm_head, BlockLinear):  # float32 written by the kernel: no cast's pass after it
            return self.lm_head(hidden, lens, float_out=True)
        head = linear(hidden, self.embed_tokens.weight, None, lens) if self.lm_head is None else \
            self.lm_head(hidden, lens)
        return head.float()
