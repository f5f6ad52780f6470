"""Weight-only quantization for CPU decoding: int8 per output channel, int4 in groups, on torch's own kernels.

Decoding streams every weight once per token, so bytes per weight set the speed. Weights stay quantized in
memory and the matmuls dequantize inside the kernel:

- int8: ``w = q * s`` with q in [-127, 127] and one scale per output row (symmetric, absmax / 127);
  ``aten._weight_int8pack_mm(x, q, s)``.
- int4: groups of ``group_size`` input columns, ``w = (q - 8) * s + z`` with q in [0, 15] (asymmetric, the
  min/max of each group, gpt-fast's scheme); ``aten._weight_int4pack_mm_for_cpu`` on the packed layout.

Few-row steps on the CPU (decode, speculative verify) run int8 on infer's own kernel (``infer::linear``,
infer.kernels): it widens each int8 weight in registers, multiplies in the activations' dtype and streams the
weights at the memory bandwidth, ~2.5x ATen's int8 kernel here. Prefill, int4, and every step without those kernels
use ATen's kernels, which take bfloat16 (or float16/float32) activations; float32 activations are cast to bfloat16
for them (ATen's float32 int8 kernel runs at a third of the speed here) and the result cast back, so the network
around the matmuls (norms, rotary, attention, residual stream) keeps the model's dtype.

Quantization changes the target: speculative decoding stays exactly lossless *relative to the quantized model*
(the verifier is the quantized model; the tests run parity and the distribution test on one).
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import Linear, few_rows_on_cpu

QUANTIZATIONS = ("int8", "int4")


# The kernels as opaque custom ops: inductor must call them as they are. Left to itself it lowers
# _weight_int8pack_mm to "dequantize the whole matrix, then GEMM", which reads and writes the weights in bfloat16
# every step (measured 5x slower than the eager kernel on SmolLM2).
@torch.library.custom_op("infer::int8_mm", mutates_args=())
def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scale)


@int8_mm.register_fake
def _(x, qweight, scale):
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.custom_op("infer::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, qweight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, group_size, scales_and_zeros)


@int4_mm.register_fake
def _(x, qweight, group_size, scales_and_zeros):
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])


class _WeightOnlyLinear(nn.Module):
    """The shared ends of a weight-only linear: inputs flattened to the kernel's dtype, outputs reshaped back."""

    bias: nn.Parameter | None
    in_features: int
    out_features: int

    def _kernel_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.reshape(-1, self.in_features).to(dtype)  # [N, in]

    def _output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(_WeightOnlyLinear):
    """y = x @ (q * s).T (+ b): q int8 ``[out, in]``, s ``[out]`` float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype):
        super().__init__()
        w = weight.detach().to(torch.float32, copy=True)  # a copy: worked on in place below (a tied head's
        lo, hi = w.aminmax(dim=1)  # weight is the embedding too); max |w| without a temporary |w|
        scale = (torch.maximum(-lo, hi) / 127).clamp(min=1e-12)  # [out]
        self.register_buffer("qweight", w.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)  # float32: what infer::linear multiplies by
        # the same scales in the dtype of ATen's kernel (prefill, CUDA, or no infer kernels): cast once, not per call
        self.register_buffer("scale_compute", scale.to(compute_dtype), persistent=False)
        self.compute_dtype = compute_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def dequantized_weight(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if few_rows_on_cpu(x):
            # decode/verify: infer's kernel widens each int8 weight in registers and keeps x's dtype
            y = torch.ops.infer.linear(x.reshape(-1, self.in_features), self.qweight, self.scale)
            return self._output(y, x)
        x2 = self._kernel_input(x, self.compute_dtype)
        if self.qweight.device.type == "cpu":
            y = int8_mm(x2, self.qweight, self.scale_compute)
        else:  # CUDA has no _weight_int8pack_mm: dequantize in the matmul (under torch.compile this fuses, gpt-fast)
            y = (x2 @ self.qweight.to(x2.dtype).t()) * self.scale_compute
        return self._output(y, x)


class Int4Linear(_WeightOnlyLinear):
    """y = x @ W.T (+ b) with W in int4 groups of ``group_size`` along the input dimension."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 group_size: int = 32):
        super().__init__()
        out_f, in_f = weight.shape
        if in_f % group_size:
            raise ValueError(f"int4: in_features {in_f} is not a multiple of group_size {group_size}")
        w = weight.detach().float().view(out_f, in_f // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)  # [out, groups]
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(out_f, in_f)
        zero = lo + 8 * scale  # so that w = (q - 8) * s + z reproduces lo + q * s
        # aten's packing tiles K by 16 * inner_k_tiles: the widest tiling (8) that divides K
        tiles = next(t for t in (8, 4, 2) if in_f % (16 * t) == 0) if in_f % 32 == 0 else None
        if tiles is None or out_f % 16:
            raise ValueError(f"int4: aten's kernel needs in_features a multiple of 32 and out_features a multiple of "
                             f"16, got a {out_f} x {in_f} weight")
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles))
        # [groups, out, 2]: (scale, zero) per group and output row, as the kernel reads them
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
                             .to(compute_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features, self.in_features, self.group_size = out_f, in_f, group_size

    def dequantized_weight(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype, device=self.qweight.device)
        return self._mm(eye).t().contiguous()  # W.T = I @ W.T, through the kernel itself

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return int4_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._output(self._mm(self._kernel_input(x, self.scales_and_zeros.dtype)), x)


def _compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if model_dtype == torch.float32 else model_dtype


def quantize_model(model, quantization: str | None, group_size: int = 32):
    """Replace every projection (and the LM head, untying it from the embedding) by its quantized twin, in place.

    The embedding table stays in the model's dtype: a lookup reads one row per token, not the whole table.
    """
    if quantization is None:
        return model
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)} or None")
    if model.quantization is not None:
        raise ValueError(f"the model is already quantized ({model.quantization}); load it again to quantize it "
                         f"as {quantization}")
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("this model is sharded for tensor parallelism, which runs unquantized weights for now")
    if getattr(model, "compiled", None) is not None:
        # compiled steps do not re-check the model's weights (infer.model.compile.step_guards): swapping them
        # under a compiled graph would run the old float layers' code on the new int8 buffers
        raise ValueError("quantize the model before compiling it (compile_model); this one is already compiled")
    if model.device.type != "cpu" and quantization == "int4":
        raise ValueError("quantization='int4' uses aten's CPU int4 kernel; on CUDA use int8 or None")
    cdt = _compute_dtype(model.dtype)

    def make(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        if quantization == "int8":
            return Int8Linear(weight, bias, cdt)
        return Int4Linear(weight, bias, cdt, group_size)

    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for parent, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            lin = getattr(parent, name)
            setattr(parent, name, make(lin.weight, lin.bias))
    head = model.lm_head_weight
    model.lm_head = make(head)
    model.quantization = quantization
    return model
