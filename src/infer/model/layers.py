"""Llama building blocks: RMSNorm, rotary embeddings (default and llama3 scaling), the gated MLP.

Numerics follow Hugging Face's LlamaForCausalLM so logits agree to float32 rounding: norms and rotary tables
are computed in float32 and cast to the activation dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import kernels
from ..config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        """``lens``: the pads the kernel skips (``linear``)"""
        if kernels_take(x, self.weight):  # every CPU step: infer's kernel, eager = compiled (kernels/norm.cpp)
            return torch.ops.infer.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, lens).view(x.shape)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one kernel, same math
        # Reduced precision: normalise in float32, cast back, then scale (Hugging Face's order of rounding).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with Llama 3.1's wavelength-dependent scaling if asked."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "default":
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by explicit positions; grown on demand (a 128k-context table is never built)."""

    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self._cos: torch.Tensor | None = None  # [N, head_dim] in the activation dtype
        self._sin: torch.Tensor | None = None

    def _build(self, n: int, device, dtype) -> None:
        n = max(256, 1 << (n - 1).bit_length())
        inv_freq = rope_inv_freq(self.head_dim, self.rope).to(device)
        freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def reserve(self, max_pos: int, device, dtype) -> None:
        """Make the tables cover positions 0..max_pos (outside any compiled region: it mutates module state)."""
        c = self._cos
        if c is None or c.shape[0] <= max_pos or c.device != device or c.dtype != dtype:
            self._build(max_pos + 1, device, dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[B, T]`` (within the reserved range) -> cos, sin ``[B, T, 1, head_dim]``."""
        return self._cos[positions].unsqueeze(2), self._sin[positions].unsqueeze(2)


# Attention backends on CUDA, cuDNN's left out: torch's first choice for bfloat16 on recent GPUs, it builds an
# execution plan for every new shape, and a decode step's key length is new every step (on an H100, ~8 ms a call
# against ~0.2 ms for the flash and memory-efficient kernels: the demo pair's batched bfloat16 rounds ran at 0.06x).
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         is_causal: bool = False, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA without the cuDNN backend (above)."""
    if q.is_cuda:
        with sdpa_kernel(_CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]``: x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int,
               lens: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``heads`` heads of each row of x ``[B, T, W]`` rotated -> ``[B, T, heads, head_dim]`` (cos, sin
    ``[B, T, 1, head_dim]``). A bfloat16 CPU step takes infer's kernel (kernels/pointwise.cpp: float32 inside, one
    rounding, the same bits eager or compiled, a row's the same in a prefill as in a decode; it skips the pads past
    ``lens``: ``linear``); float32 has no rounding for inductor to skip."""
    B, T, W = x.shape
    if x.dtype == torch.bfloat16 and kernels_take(x):
        # positions may be shared by the batch (cos [1, T, 1, D], a forward without a cache): one row of cos a row
        cos, sin = (t.expand(B, T, 1, head_dim).reshape(B * T, head_dim) for t in (cos, sin))
        y = torch.ops.infer.rope(x.reshape(B * T, W), cos, sin, heads, head_dim, lens)
        return y.view(B, T, heads, head_dim)
    return apply_rope(x[..., : heads * head_dim].view(B, T, heads, head_dim), cos, sin)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations infer::linear takes


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           lens: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[..., in]`` @ weight ``[out, in]``.T (+ bias). ``lens`` ([B], x ``[B, T, in]``): row b's tokens from
    lens[b] on are pads, which infer's kernels skip (output 0: kernels/rows.h); other paths compute them.

    Decoding streams every weight once per step, so its speed is memory bandwidth. A few-row product on the CPU
    (decode, speculative verify) goes to ``infer::linear`` (infer.kernels), which reads the weights at the
    bandwidth and gives each row the same result whatever else shares the call. Without those kernels, under
    torch.compile a single row is written as ``W @ x``, which inductor lowers to its own reduction (~2x the
    bandwidth of ATen's one-row GEMM here). Everything else is ATen's GEMM; a many-row bfloat16 product on a CPU
    without bfloat16 matrix units (a prefill) runs in float32: ATen's bfloat16 GEMM on AVX2 is ~6x slower than
    converting both operands and using the float32 one (283 x 512 x 3072: 47 vs 7 ms here).
    """
    if few_rows_on_cpu(x, weight, bias):
        y = torch.ops.infer.linear(x.reshape(-1, x.shape[-1]), weight, None, lens).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
        y = (weight @ x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not _CPU_HAS_BF16_MATMUL:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


# AVX512-BF16 / AMX make ATen's bfloat16 GEMM fast; without them (AVX2) it is emulated
_CPU_HAS_BF16_MATMUL = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def few_rows_on_cpu(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether infer's per-row kernels (linear, norm, rope, silu * up) take x: a CPU step of at most kernels.MAX_ROWS
    tokens a row, x ``[B, T, ...]`` with T <= MAX_ROWS whatever the batch (decode, verify, a tree, a short prefill
    chunk), or ``[N, H]`` with N <= MAX_ROWS. Where autograd records (training), at most MAX_ROWS rows in all, as
    before (the kernels have no backward: a training batch's products go to ATen): where x or one of ``params`` (the
    op's weights) wants a gradient. The weights count too: a head's norm over the frozen embedding has an input
    that needs none and a weight that does (tests/test_draft_heads.py).

    By tokens a row, not rows in all: each kernel's result for a row does not depend on the rows beside it, so a
    batch's decode [B, 1] and verify [B, K+1] give each row the same bits only if both take the kernels. Counting
    B x T sent a verify of 8 rows x 3 tokens to ATen's ops (another rounding) while its decode took the kernels, and
    batched greedy speculation parted from plain decoding at near-ties (tests/test_kernels.py)."""
    tokens = x.shape[-2] if x.dim() >= 3 else x.shape[0] if x.dim() == 2 else 1
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        tokens = x.numel() // max(1, x.shape[-1])
    return x.device.type == "cpu" and tokens <= kernels.MAX_ROWS and x.dtype in KERNEL_DTYPES and kernels.available()


def kernels_take(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether infer's row-wise kernels (norm, rope, silu * up, attention over a cache) take x, whatever its rows: a
    CPU step of any length, a prefill's too. A row's result does not depend on the rows beside it, so a prompt's
    states come out with the bits its tokens would have decoded one by one, where the products are batch-invariant
    too (infer::qlinear's blocks: tests/test_kernels.py). ATen's eager chains for a 46-token bfloat16 prefill cost
    ~9% of it, and its flash attention ~3x the kernel's time (0.16 against 0.05 ms a layer; 2.5 against 1.65 ms at
    330 tokens). Products are another matter (``few_rows_on_cpu``: a matrix-vector kernel). Where autograd records,
    the few-row rule, as before."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return few_rows_on_cpu(x, *params)
    return x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and kernels.available()


class Linear(nn.Linear):
    """nn.Linear whose one-row products take the matrix-vector form under torch.compile (see ``linear``)."""

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, lens)


def project(proj: nn.Module, x: torch.Tensor, lens: torch.Tensor | None, adapters: torch.Tensor | None):
    """``proj(x, lens)``, given each row's adapter (``adapters`` [B]) where ``proj`` carries per-request LoRA
    adapters (model.lora.LoRALinear)."""
    if adapters is not None and getattr(proj, "per_request", False):
        return proj(x, lens, adapters)
    return proj(x, lens)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None,
                adapters: torch.Tensor | None = None) -> torch.Tensor:
        """``lens``: the pads to skip (``linear``); ``adapters``: each row's LoRA adapter (``project``)"""
        gate_up = project(self.gate_up_proj, x, lens, adapters)
        if gate_up.dtype == torch.bfloat16 and kernels_take(gate_up):  # one rounding, eager = compiled (rope_heads)
            h = torch.ops.infer.silu_mul(gate_up.reshape(-1, 2 * self.intermediate), lens)
            return project(self.down_proj, h.view(*x.shape[:-1], self.intermediate), lens, adapters)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return project(self.down_proj, F.silu(gate) * up, lens, adapters)
