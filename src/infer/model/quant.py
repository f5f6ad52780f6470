"""Quantization for CPU decoding: weight-only int8 per output row, and llama.cpp's block types (Q8_0, Q4_0, Q4_1,
Q4_K) with int8 activations on integer dot products.

Decoding streams every weight once per token, so bytes per weight set the speed; verifying K+1 drafted tokens must
not multiply the arithmetic. ``quantization=`` names what a model runs:

- ``"int8"`` (``Int8Linear``): ``w = q * s``, q in [-127, 127], one scale per output row (absmax / 127). Weight-only:
  the activations stay in the model's dtype. Few-row CPU steps run infer's ``infer::linear`` (each weight widened to
  float32 in registers), prefill ATen's ``_weight_int8pack_mm``. Numerically: the weights' rounding only.
- ``"q8_0"``, ``"q4_0"``, ``"q4_1"`` (``BlockLinear``): llama.cpp's blocks of 32 input columns with a float16 scale
  (Q4_1: and a minimum): ``w = d q`` (q int8), ``w = d (q - 8)`` (q in [0, 15]), ``w = d q + m`` (q in [0, 15]),
  quantized by llama.cpp's reference arithmetic (``quantize_blocks``; the same bytes as gguf-py's quantizer). A GGUF
  whose tensors already are of that type is run on its own blocks, byte for byte (``model.source_blocks``, set by the
  loader); another type is dequantized exactly to float32 first. The LM head stays Q8_0 with the 4-bit types, as
  llama.cpp's quantizer keeps its output tensor 8-bit. Every CPU product, prompt and steps alike, runs
  ``infer::qlinear``: each call quantizes its activations to int8 per row and block of 32 (``d = max|x| / 127``,
  round to nearest), so a verify of K+1 rows costs little more than a decode (kernels/qlinear.cpp). Numerically:
  besides the weights' rounding, every activation entering a projection is rounded to 1/127 of its block's largest
  magnitude, as llama.cpp does. ``"int4"`` is another name for ``"q4_1"``.
- ``"gguf"``: every tensor of a GGUF in the file's own block type where the kernel takes it (Q8_0, Q4_0, Q4_1, and
  Q4_K: super-blocks of 256 columns, ``w = d sc q - dmin mn`` with 6-bit sub-block scales and minimums), Q8_0
  elsewhere (and for a checkpoint that is not a GGUF): what llama.cpp runs, with int8 activations as there. Q4_K
  blocks come from files only (llama.cpp's K-quant search is not reimplemented here, nor in gguf-py).

Quantization changes the target: speculative decoding stays exactly lossless *relative to the quantized model*
(the verifier is the quantized model; the tests run parity and the distribution test on one).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from .layers import Linear, few_rows_on_cpu

# int4: another name for q4_1 (it replaced ATen's int4); gguf: each tensor in its file's block type where the
# kernel takes it (Q8_0, Q4_0, Q4_1, Q4_K), Q8_0 elsewhere
QUANTIZATIONS = ("int8", "q8_0", "q4_0", "q4_1", "int4", "gguf")


# The kernels as opaque custom ops: inductor must call them as they are. Left to itself it lowers
# _weight_int8pack_mm to "dequantize the whole matrix, then GEMM", which reads and writes the weights in bfloat16
# every step (measured 5x slower than the eager kernel on SmolLM2).
@torch.library.custom_op("infer::int8_mm", mutates_args=())
def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scale)


@int8_mm.register_fake
def _(x, qweight, scale):
    return x.new_empty(x.shape[0], qweight.shape[0])


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

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None) -> torch.Tensor:
        if few_rows_on_cpu(x):
            # decode/verify: infer's kernel widens each int8 weight in registers and keeps x's dtype (and skips
            # the pads past ``lens``: layers.linear)
            y = torch.ops.infer.linear(x.reshape(-1, self.in_features), self.qweight, self.scale, lens)
            return self._output(y, x)
        x2 = self._kernel_input(x, self.compute_dtype)
        if self.qweight.device.type == "cpu":
            y = int8_mm(x2, self.qweight, self.scale_compute)
        else:  # CUDA has no _weight_int8pack_mm: dequantize in the matmul (under torch.compile this fuses, gpt-fast)
            y = (x2 @ self.qweight.to(x2.dtype).t()) * self.scale_compute
        return self._output(y, x)


# llama.cpp's block types for infer::qlinear, by name: (GGML type id, bytes per block of 32 columns)
BLOCK_FORMATS = {"q8_0": (8, 34), "q4_0": (2, 18), "q4_1": (3, 20), "q4_k": (12, 144)}
BLOCK_COLUMNS = {"q4_k": 256}  # columns per block where not 32 (Q4_K's super-blocks)
_HEAD_FORMAT = "q8_0"  # the LM head of a 4-bit model stays 8-bit, as llama.cpp's quantizer keeps its output tensor


def _round_away(v: torch.Tensor) -> torch.Tensor:  # C's roundf: halves away from zero (torch.round goes to even)
    return v.sign() * (v.abs() + 0.5).floor()


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:  # [n] float -> [n, 2] bytes of its float16
    return v.to(torch.float16).view(torch.uint8).view(-1, 2)


def _nibble_bytes(q: torch.Tensor) -> torch.Tensor:  # [n, 32] in [0, 15] -> [n, 16]: element j low, j + 16 high
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def quantize_blocks(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight [N, K]`` -> its rows as llama.cpp's blocks of 32 columns, uint8 ``[N, nb * block bytes]``, with the
    arithmetic of llama.cpp's reference quantizers (quantize_row_q8_0_ref, _q4_0_ref, _q4_1_ref: the scale computed
    in float32, used for the quants, stored as float16). K is padded with zeros to a multiple of 32."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block type {fmt!r}; infer's integer kernel takes {', '.join(BLOCK_FORMATS)}")
    if fmt == "q4_k":  # llama.cpp's K-quant search (make_qkx2_quants) is not reimplemented: gguf-py lacks it too
        raise ValueError("q4_k blocks come from a GGUF file only (quantization='gguf' runs a file's Q4_K tensors); "
                         "infer quantizes to q8_0, q4_0 or q4_1")
    n, k = weight.shape
    nb = -(-k // 32)
    x = torch.zeros(n, nb * 32, dtype=torch.float32)
    x[:, :k] = weight.detach().float().cpu()
    x = x.view(n * nb, 32)
    if fmt == "q8_0":
        d = x.abs().amax(1) / 127
        inv = torch.where(d > 0, 1 / d, 0)
        q = _round_away(x * inv[:, None]).to(torch.int8).view(torch.uint8)
        out = torch.cat([_f16_bytes(d), q], 1)
    elif fmt == "q4_0":
        at = x.abs().argmax(1, keepdim=True)  # the first entry of largest magnitude, with its sign
        d = x.gather(1, at)[:, 0] / -8
        inv = torch.where(d != 0, 1 / d, 0)
        q = (x * inv[:, None] + 8.5).trunc().clamp(max=15)
        out = torch.cat([_f16_bytes(d), _nibble_bytes(q)], 1)
    else:
        lo, hi = x.amin(1), x.amax(1)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1 / d, 0)
        q = ((x - lo[:, None]) * inv[:, None] + 0.5).trunc().clamp(max=15)
        out = torch.cat([_f16_bytes(d), _f16_bytes(lo), _nibble_bytes(q)], 1)
    return out.reshape(n, -1).to(weight.device).contiguous()


def dequantize_blocks(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """The float32 weights ``[N, in_features]`` that ``blocks`` (rows of llama.cpp's blocks) stand for: the GGUF
    reader's own dequantization (torch's for Q8_0/Q4_0/Q4_1, gguf-py's for Q4_K)."""
    import gguf

    from .gguf import _TORCH_DEQUANT, _torch_dequantize

    qtype, data = gguf.GGMLQuantizationType(BLOCK_FORMATS[fmt][0]), blocks.cpu().numpy()
    w = _torch_dequantize(data, qtype) if qtype in _TORCH_DEQUANT else \
        torch.from_numpy(gguf.quants.dequantize(data, qtype))
    return w[:, :in_features].to(blocks.device)


def pack_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows of llama.cpp's blocks ``[N, nb * block bytes]`` -> infer::qlinear's layout ``[ceil(N / 8), nb * chunk]``:
    the same values, rows interleaved by 8 (kernels/qlinear.cpp draws it): per group of 8 rows and block, the 8
    rows' float16 scales (Q4_1: then their minimums), then the quants so that each 32 bytes hold 4 columns of every
    row (Q8_0 as q + 128; 4-bit as nibbles, columns 8j..8j+3 low and 8j+4..8j+7 high). N is padded with zero rows."""
    bb = BLOCK_FORMATS[fmt][1]
    n, row = blocks.shape
    nb, ng = row // bb, -(-n // 8)
    if fmt == "q4_k":
        return _pack_q4_k(blocks, nb, ng)
    b = torch.zeros(ng * 8, nb, bb, dtype=torch.uint8)
    b[:n] = blocks.cpu().reshape(n, nb, bb)
    b = b.view(ng, 8, nb, bb).transpose(1, 2)  # [groups, blocks, 8 rows, block bytes]
    scales = b[..., :4 if fmt == "q4_1" else 2]  # d (and m) per row
    if fmt == "q4_1":
        scales = torch.cat([scales[..., :2], scales[..., 2:]], 2)  # 8 d's, then 8 m's
    scales = scales.reshape(ng, nb, -1)
    if fmt == "q8_0":
        q = (b[..., 2:] ^ 0x80).reshape(ng, nb, 8, 8, 4).transpose(2, 3)  # [.., j, row, 4 columns]
    else:
        qs = b[..., -16:]
        v = torch.cat([qs & 0x0F, qs >> 4], -1).reshape(ng, nb, 8, 4, 8)  # [.., row, j, 8 columns]
        q = (v[..., :4] | (v[..., 4:] << 4)).transpose(2, 3)  # [.., j, row, 4 bytes]
    return torch.cat([scales, q.reshape(ng, nb, -1)], -1).reshape(ng, -1).contiguous().to(blocks.device)


def unpack_blocks(packed: torch.Tensor, fmt: str, out_features: int) -> torch.Tensor:
    """The inverse of ``pack_blocks``: rows of llama.cpp's blocks ``[out_features, nb * block bytes]``."""
    bb = BLOCK_FORMATS[fmt][1]
    ng = packed.shape[0]
    if fmt == "q4_k":
        return _unpack_q4_k(packed, out_features)
    sb = 32 if fmt == "q4_1" else 16
    c = packed.cpu().reshape(ng, -1, sb + (256 if fmt == "q8_0" else 128))
    nb = c.shape[1]
    scales = c[..., :sb].reshape(ng, nb, sb // 16, 8, 2).transpose(2, 3).reshape(ng, nb, 8, -1)
    if fmt == "q8_0":
        q = (c[..., sb:].reshape(ng, nb, 8, 8, 4).transpose(2, 3) ^ 0x80).reshape(ng, nb, 8, 32)
    else:
        t = c[..., sb:].reshape(ng, nb, 4, 8, 4).transpose(2, 3)  # [.., row, j, 4 bytes]
        v = torch.cat([t & 0x0F, t >> 4], -1).reshape(ng, nb, 8, 32)  # columns in order
        q = v[..., :16] | (v[..., 16:] << 4)
    b = torch.cat([scales, q], -1).transpose(1, 2).reshape(ng * 8, nb * bb)
    return b[:out_features].contiguous().to(packed.device)


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's get_scale_min_k4 over Q4_K's 12 scale bytes [..., 12] -> 6-bit (scale, min) [..., 8] each."""
    s = s.to(torch.int32)
    lo, hi = s[..., :4], s[..., 4:8]
    sc = torch.cat([lo & 63, (s[..., 8:] & 0xF) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([hi & 63, (s[..., 8:] >> 4) | ((hi >> 6) << 4)], -1)
    return sc, mn


def _q4_k_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The inverse of _q4_k_scales: (scale, min) [..., 8] -> the 12 bytes."""
    return torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                      (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], -1).to(torch.uint8)


def _pack_q4_k(blocks: torch.Tensor, nsb: int, ng: int) -> torch.Tensor:
    """Q4_K rows (144 bytes per 256 columns: d, dmin, 12 scale bytes, 128 of nibbles whose 32-byte quarter c holds
    columns 64c.. low and 64c + 32.. high) -> per group of 8 rows and super-block: 8 d's, 8 dmin's, the sub-blocks'
    scales [sub-block][row] and minimums as bytes, then each sub-block's nibbles as pack_blocks lays out Q4_0's."""
    n = blocks.shape[0]
    b = torch.zeros(ng * 8, nsb, 144, dtype=torch.uint8)
    b[:n] = blocks.cpu().reshape(n, nsb, 144)
    b = b.view(ng, 8, nsb, 144).transpose(1, 2)  # [groups, super-blocks, 8 rows, 144]
    sc, mn = _q4_k_scales(b[..., 4:16])  # [.., 8 rows, 8 sub-blocks]
    qs = b[..., 16:].reshape(ng, nsb, 8, 4, 32)
    v = torch.stack([qs & 0x0F, qs >> 4], 4).reshape(ng, nsb, 8, 8, 4, 8)  # [.., row, sub-block, j, 8 columns]
    q = (v[..., :4] | (v[..., 4:] << 4)).permute(0, 1, 3, 4, 2, 5)  # [.., sub-block, j, row, 4 bytes]
    parts = [b[..., 0:2].reshape(ng, nsb, 16), b[..., 2:4].reshape(ng, nsb, 16),
             sc.transpose(2, 3).to(torch.uint8).reshape(ng, nsb, 64), mn.transpose(2, 3).to(torch.uint8)
             .reshape(ng, nsb, 64), q.reshape(ng, nsb, 1024)]
    return torch.cat(parts, -1).reshape(ng, -1).contiguous().to(blocks.device)


def _unpack_q4_k(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    ng = packed.shape[0]
    c = packed.cpu().reshape(ng, -1, 1184)
    nsb = c.shape[1]
    d, dmin = c[..., 0:16].reshape(ng, nsb, 8, 2), c[..., 16:32].reshape(ng, nsb, 8, 2)
    sc = c[..., 32:96].reshape(ng, nsb, 8, 8).transpose(2, 3).to(torch.int32)  # [.., row, sub-block]
    mn = c[..., 96:160].reshape(ng, nsb, 8, 8).transpose(2, 3).to(torch.int32)
    t = c[..., 160:].reshape(ng, nsb, 8, 4, 8, 4).permute(0, 1, 4, 2, 3, 5)  # [.., row, sub-block, j, 4 bytes]
    v = torch.cat([t & 0x0F, t >> 4], -1).reshape(ng, nsb, 8, 4, 2, 32)  # [.., row, quarter, low/high, 32]
    qs = v[..., 0, :] | (v[..., 1, :] << 4)  # [.., row, quarter, 32]
    b = torch.cat([d, dmin, _q4_k_scale_bytes(sc, mn), qs.reshape(ng, nsb, 8, 128)], -1)
    return b.transpose(1, 2).reshape(ng * 8, nsb * 144)[:out_features].contiguous().to(packed.device)


class BlockLinear(_WeightOnlyLinear):
    """y = x @ W.T (+ b) with W in llama.cpp's blocks (Q8_0 / Q4_0 / Q4_1 / Q4_K, ``BLOCK_FORMATS``) and the
    activations quantized to int8 blocks at each call, multiplied with integer dot products by ``infer::qlinear``
    (kernels/qlinear.cpp states the numerics). Every CPU product takes that kernel, prompt and steps alike;
    without the kernels (CUDA, a failed build) the dequantized weights multiply unquantized activations."""

    def __init__(self, blocks: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype):
        super().__init__()
        fid, bb = BLOCK_FORMATS[fmt]
        nb = -(-in_features // BLOCK_COLUMNS.get(fmt, 32))
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != nb * bb:
            raise ValueError(f"{fmt} blocks for {in_features} columns must be uint8 [N, {nb * bb}], got "
                             f"{blocks.dtype} {list(blocks.shape)}")
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.register_buffer("packed", pack_blocks(blocks, fmt))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.fmt, self.format_id, self.compute_dtype = fmt, fid, compute_dtype
        self._dequantized: torch.Tensor | None = None  # the fallback's weights [in, out], made on first use

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype, fmt: str):
        return cls(quantize_blocks(weight, fmt), fmt, weight.shape[1], bias, compute_dtype)

    def blocks(self) -> torch.Tensor:
        """The weights as rows of llama.cpp's blocks (as a GGUF stores them)."""
        return unpack_blocks(self.packed, self.fmt, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_blocks(self.blocks(), self.fmt, self.in_features).to(self.compute_dtype)

    def forward(self, x: torch.Tensor, lens: torch.Tensor | None = None, float_out: bool = False) -> torch.Tensor:
        """``float_out``: the result in float32, with the bits of ``forward(x, lens).float()`` (a model's logits): the
        kernel writes them so, saving the cast's pass over [rows, out_features]."""
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu" and kernels.available():  # pads past ``lens`` skipped (layers.linear)
            if float_out and self.bias is None:
                y = torch.ops.infer.qlinear(x2, self.packed, self.format_id, self.out_features, lens, True)
                return y.view(*x.shape[:-1], self.out_features)
            y = torch.ops.infer.qlinear(x2, self.packed, self.format_id, self.out_features, lens)
        else:  # no integer kernel here (CUDA, a failed build): the weights dequantized once, kept beside the blocks
            if self._dequantized is None:
                self._dequantized = self.dequantized_weight().t()
            y = x2.to(self.compute_dtype) @ self._dequantized
        y = self._output(y, x)
        return y.float() if float_out else y


def _compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if model_dtype == torch.float32 else model_dtype


def quantize_model(model, quantization: str | None):
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
    cdt = _compute_dtype(model.dtype)

    source = getattr(model, "source_blocks", None) or (lambda module: None)

    def make(module: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        if quantization == "int8":
            return Int8Linear(weight, bias, cdt)
        fmt = _HEAD_FORMAT if module == "lm_head" else "q4_1" if quantization == "int4" else quantization
        found = source(module)  # a GGUF's own rows: kept as stored when of this type, else dequantized exactly
        if quantization == "gguf":
            fmt = found[0] if found is not None else _HEAD_FORMAT
        if found is not None and found[0] == fmt:
            return BlockLinear(found[1].to(weight.device), fmt, weight.shape[1], bias, cdt)
        if found is not None:
            weight = dequantize_blocks(found[1], found[0], weight.shape[1]).to(weight.device)  # exact float32
        return BlockLinear.quantize(weight, bias, cdt, fmt)

    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for parent, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            lin = getattr(parent, name)
            where = f"layers.{i}.{'self_attn' if parent is attn else 'mlp'}.{name}"
            setattr(parent, name, make(where, lin.weight, lin.bias))
    model.lm_head = make("lm_head", model.lm_head_weight)
    model.source_blocks = None  # the file's map is not needed any more
    model.quantization = quantization
    return model


def quantize_linears(module: nn.Module, quantization: str) -> nn.Module:
    """Replace every projection of a module that is not a LlamaForCausalLM (a drafter's head: model.draft_heads) by
    its quantized twin, in place: ``"int8"`` or one of the block types (``Int8Linear`` / ``BlockLinear``; "int4" =
    "q4_1"). Modules already quantized are left as they are."""
    if quantization not in QUANTIZATIONS or quantization == "gguf":
        raise ValueError(f"unknown quantization {quantization!r} for a head; use int8, q8_0, q4_0, q4_1 or int4")
    if getattr(module, "compiled", None) is not None:
        raise ValueError("quantize the module before compiling it; this one is already compiled")
    fmt = "q4_1" if quantization == "int4" else quantization
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            cdt = _compute_dtype(child.weight.dtype)
            setattr(module, name, Int8Linear(child.weight, child.bias, cdt) if fmt == "int8"
                    else BlockLinear.quantize(child.weight.detach(), child.bias, cdt, fmt))
        elif not isinstance(child, _WeightOnlyLinear):
            quantize_linears(child, quantization)
    return module
