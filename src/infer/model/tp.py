"""Tensor parallelism for the Llama runtime, Megatron-style, over torch.distributed (gloo on CPU, NCCL on CUDA).

    torch.distributed.init_process_group("gloo", rank=r, world_size=n, ...)   # in every rank's process
    model = load_model(path); shard_model(model)                                # each rank keeps its 1/n

Sharding (Shoeybi et al. 2019):
- attention: the fused q/k/v projection column-parallel by KV-head groups (rank r keeps a contiguous run of KV heads
  and their query heads, as even as the count allows: SmolLM2's 3 KV heads over 2 ranks are 1 + 2), ``o_proj``
  row-parallel, then one all-reduce;
- MLP: gate and up column-parallel (each rank's slice of the intermediate, as even as the width allows: 131 over 2
  ranks is 65 + 66; the row-parallel ``down_proj`` sums partial products, which needs no equal slices), one
  all-reduce;
- embedding vocabulary-parallel (each rank embeds the ids in its slice, zeros elsewhere; all-reduce) and the LM head
  likewise (each rank's slice of the logits, all-gathered into the whole vocabulary before sampling). The gather
  needs equal slices, so the vocabulary is padded up to a multiple of the rank count (vLLM's vocabulary-parallel
  layers do the same): rank r holds rows [r * ceil(V / n), ...), zero rows past V, and the gathered logits are cut
  back to V columns at once, so no padded id reaches sampling, logprobs or verification.
Row-parallel biases are kept on rank 0 only (the all-reduce sums them once). ``model.config`` becomes the rank's
local shape (its heads, KV heads and intermediate size) so a KV pool built for the model holds the rank's KV heads;
the vocabulary size stays global (logits are gathered).

The model stays a plain nn.Module: every rank runs the same forward on the same inputs (SPMD), and the collectives
keep them in step. An engine on every rank, fed the same requests, makes the same scheduling decisions, so KV pools,
rollbacks and tree compaction stay in step, provided every decision is a function of the inputs: a pinned K (auto K
and auto trees decide from each rank's own timings) and seeded requests (an unseeded request draws its seed from each
rank's own entropy). A rank that decides differently runs collectives of other shapes: an error or a hang. A rank
that dies makes the others' next collective fail at once with a TensorParallelError (gloo sees the connection
close), which an engine's loop turns into an error for every request in flight; ``init_process_group(timeout=...)``
bounds a rank that hangs instead. The
executor (engine/tp_executor.py, ``tensor_parallel_size``) lifts both conditions: rank 0 makes every decision and the
workers only repeat its target calls. Run SPMD, a separate draft model runs unsharded (TP 1) on every rank; EAGLE and
Medusa heads borrow the target's embedding and LM head, which are sharded here, so they do not work under tensor
parallelism. Weights are unquantized.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from .llama import LlamaForCausalLM


class TensorParallelError(RuntimeError):
    """A collective failed: a rank is gone (its process died, its connection closed) or timed out."""


def _collective(op, *args, group=None):
    """Run a torch.distributed collective; a failure (gloo reports a lost peer at once, and every collective times
    out after init_process_group's ``timeout``) becomes a TensorParallelError saying what happened."""
    try:
        op(*args, group=group)
    except RuntimeError as e:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        raise TensorParallelError(f"tensor-parallel {op.__name__} failed on rank {rank} of {world}: another rank "
                                  f"is gone or timed out ({str(e).splitlines()[0][:200]})") from e


class AllReduce(nn.Module):
    """``inner(x)`` summed over the ranks: the end of a row-parallel product."""

    def __init__(self, inner: nn.Module, group=None):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        y = self.inner(x, lens)
        _collective(dist.all_reduce, y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding; ids outside embed as zeros, the all-reduce fills them in."""

    def __init__(self, weight: torch.Tensor, lo: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.lo, self.hi, self.group = lo, lo + weight.shape[0], group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        x = nn.functional.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        x = x * mine[..., None].to(x.dtype)
        _collective(dist.all_reduce, x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """The LM head's rows for the rank's vocabulary slice (padded to ceil(V / n) rows); the logits are all-gathered
    and cut to the vocabulary: [..., V]."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, hidden: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        from .layers import linear

        part = linear(hidden, self.weight, None, lens).contiguous()  # [..., ceil(V/n)]
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(self.group))]
        _collective(dist.all_gather, parts, part, group=self.group)
        return torch.cat(parts, -1)[..., :self.vocab_size]  # the padding's columns never leave this layer


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w[start:start + n].clone()


def _padded_rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of ``w``, zero rows where they run past its end."""
    out = w.new_zeros(n, *w.shape[1:])
    part = w[start:start + n]
    out[:len(part)] = part
    return out


def even_bounds(total: int, world: int) -> list[int]:
    """Bounds of each rank's share of ``total`` as even as possible, e.g. 131 over 2 -> [0, 65, 131]."""
    return [total * r // world for r in range(world + 1)]


def kv_groups(num_kv_heads: int, world: int) -> list[int]:
    """Bounds of each rank's run of KV heads (with their query heads): as even as possible, e.g. 3 heads over 2 ranks
    -> [0, 1, 3]. Uneven runs are fine: each rank keeps whole query groups, so grouped-query attention stays a uniform
    H/Hkv per rank, and the all-reduces are over the hidden size, the same on every rank."""
    return even_bounds(num_kv_heads, world)


def check_shardable(cfg, world: int) -> None:
    """Raise ValueError naming what ``world`` cannot split (any vocabulary and MLP width split; KV heads cannot be
    shared between ranks)."""
    if cfg.num_key_value_heads < world:
        raise ValueError(f"tensor_parallel_size={world} exceeds num_key_value_heads ({cfg.num_key_value_heads}): "
                         f"every rank needs a KV head of its own; tensor_parallel_size <= "
                         f"{cfg.num_key_value_heads} works for this model")


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, group=None) -> LlamaForCausalLM:
    """Keep this rank's shard of every layer (module docstring); in place, returns the model."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = model.config
    check_shardable(cfg, world)
    if model.quantization is not None:
        raise ValueError("tensor parallelism runs unquantized weights for now: load the model without quantization")
    G, D = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    g0, g1 = kv_groups(cfg.num_key_value_heads, world)[rank:rank + 2]
    Hkv, H = g1 - g0, (g1 - g0) * G  # this rank's KV heads and their query heads
    i0, i1 = even_bounds(cfg.intermediate_size, world)[rank:rank + 2]
    I, V = i1 - i0, -(-cfg.vocab_size // world)  # this rank's MLP width; each rank's vocabulary rows, padded
    for layer in model.layers:
        attn = layer.self_attn
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        q0, k0 = g0 * G * D, attn.q_size + g0 * D
        v0 = attn.q_size + attn.kv_size + g0 * D
        attn.qkv_proj.weight = nn.Parameter(torch.cat([_rows(w, q0, H * D), _rows(w, k0, Hkv * D),
                                                       _rows(w, v0, Hkv * D)]), requires_grad=False)
        if b is not None:
            attn.qkv_proj.bias = nn.Parameter(torch.cat([_rows(b, q0, H * D), _rows(b, k0, Hkv * D),
                                                         _rows(b, v0, Hkv * D)]), requires_grad=False)
        o = attn.o_proj
        o.weight = nn.Parameter(o.weight[:, q0:q0 + H * D].clone(), requires_grad=False)
        if o.bias is not None and rank:
            o.bias.zero_()  # summed once, by rank 0's
        attn.n_heads, attn.n_kv, attn.q_size, attn.kv_size = H, Hkv, H * D, Hkv * D
        attn.o_proj = AllReduce(o, group)

        mlp = layer.mlp
        w, b, full = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.intermediate
        mlp.gate_up_proj.weight = nn.Parameter(torch.cat([_rows(w, i0, I), _rows(w, full + i0, I)]),
                                               requires_grad=False)
        if b is not None:
            mlp.gate_up_proj.bias = nn.Parameter(torch.cat([_rows(b, i0, I), _rows(b, full + i0, I)]),
                                                 requires_grad=False)
        d = mlp.down_proj
        d.weight = nn.Parameter(d.weight[:, i0:i1].clone(), requires_grad=False)
        if d.bias is not None and rank:
            d.bias.zero_()
        mlp.intermediate = I
        mlp.down_proj = AllReduce(d, group)

    head = model.lm_head_weight  # the embedding itself when tied
    model.lm_head = VocabParallelHead(_padded_rows(head, rank * V, V), cfg.vocab_size, group)
    model.embed_tokens = VocabParallelEmbedding(_padded_rows(model.embed_tokens.weight, rank * V, V), rank * V, group)
    model.config = replace(cfg, num_attention_heads=H, num_key_value_heads=Hkv, intermediate_size=I)
    model.tensor_parallel = (rank, world)
    return model
