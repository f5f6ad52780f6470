"""infer::qlinear (kernels/qlinear.cpp): llama.cpp's Q8_0 / Q4_0 / Q4_1 weight blocks x int8 activation blocks.
Blocks byte-identical to llama.cpp's reference quantizers (gguf-py's), the packed layout round-trips, values against
a float64 emulation of the same quantization and against the exact product within the quantization's bound, batch
invariance (a row alone or among 16: bit-identical), odd shapes, the AVX2 build on an AVX-512 host, clear errors."""

import gguf
import numpy as np
import pytest
import torch

from infer import kernels
from infer.model.quant import BLOCK_FORMATS, BlockLinear, dequantize_blocks, pack_blocks, quantize_blocks, unpack_blocks

from test_kernels import run_in_the_avx2_build

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ toolchain to build infer's kernels")
FORMATS = [f for f in BLOCK_FORMATS if f != "q4_k"]  # the types infer quantizes to (Q4_K: from files, below)
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1}


def _quantize_rows(x: torch.Tensor):
    """The activations' quantization as the kernel states it: per row and block of 32, d = max |x| / 127,
    q = round-half-even(x * (127 / max |x|)) in float32."""
    m, k = x.shape
    nb = -(-k // 32)
    xp = torch.zeros(m, nb * 32, dtype=torch.float32)
    xp[:, :k] = x.float()
    xb = xp.view(m, nb, 32)
    amax = xb.abs().amax(-1)  # [M, nb]
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # float32, as the kernel computes it
    q = torch.round(xb * inv[..., None])
    return q.view(m, -1), amax / 127


def _case(fmt, n, k, m, seed=0, outliers=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen)
    if outliers:  # a few large activations, as LLMs have: the block scales keep the rest precise
        x[:, ::17] *= 30
    blocks = quantize_blocks(w, fmt)
    return w, x, blocks, pack_blocks(blocks, fmt)


def _qlinear(x, packed, fmt, n):
    return torch.ops.infer.qlinear(x, packed, BLOCK_FORMATS[fmt][0], n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_llama_cpps_and_the_packing_round_trips(fmt):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(13, 96, generator=gen) * 0.1
    w[0, :32] = 0  # an all-zero block: scale 0, no division by zero
    ours = quantize_blocks(w, fmt)
    assert np.array_equal(ours.numpy(), gguf.quants.quantize(w.numpy(), GGML[fmt]))  # llama.cpp's reference
    assert torch.equal(dequantize_blocks(ours, fmt, 96),
                       torch.from_numpy(gguf.quants.dequantize(ours.numpy(), GGML[fmt])))
    assert torch.equal(unpack_blocks(pack_blocks(ours, fmt), fmt, 13), ours)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [576, 1536, 100, 37, 32])
@pytest.mark.parametrize("outliers", [False, True])
def test_qlinear_matches_the_emulated_quantization_and_stays_within_its_bound(fmt, k, outliers):
    n, m = 67, kernels.MAX_ROWS
    w, x, blocks, packed = _case(fmt, n, k, m, seed=k, outliers=outliers)
    y = _qlinear(x, packed, fmt, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # the same integers and scales in float64: the kernel may differ only by its float32 sums over blocks
    qx, dx = _quantize_rows(x)
    xh = (qx.view(m, -1, 32) * dx[..., None]).view(m, -1)[:, :k].double()  # x as quantized
    wh = dequantize_blocks(blocks, fmt, k).double()  # W as quantized
    emulated = xh @ wh.t()
    assert (y.double() - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    # against the exact product: |x w - x^ w^| <= sum_k |x - x^| |w| + |x^| |w - w^|
    bound = (x.double() - xh).abs() @ w.double().abs().t() + xh.abs() @ (w.double() - wh).abs().t()
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [301, 8, 5, 64, 24])
def test_qlinear_is_batch_invariant(fmt, n, k=136):
    """Row i alone, among the first j rows, or among all 16 (or 37, a prompt's): bit-identical (decode == speculative
    verify == prefill), whatever the register tile (301 rows leave a partial group of 8 and odd group counts, 24 rows
    three groups: a pair of 16 lanes and one of 8 in the AVX-512 build; 16 and 37 rows run several tiles)."""
    w, x, blocks, packed = _case(fmt, n, k, 37, seed=n)
    prompt = _qlinear(x, packed, fmt, n)
    if torch.ops.infer.qlinear_pairs(False):  # the AVX-512 build's 16-lane pairs off: its 8-lane tiles, the same bits
        try:
            assert torch.equal(_qlinear(x, packed, fmt, n), prompt)
            assert torch.equal(_qlinear(x[:5], packed, fmt, n), prompt[:5])
            assert torch.equal(_qlinear(x[:1], packed, fmt, n), prompt[:1])  # decode's 8-lane tiles
        finally:
            torch.ops.infer.qlinear_pairs(True)
    x = x[:kernels.MAX_ROWS]
    full = _qlinear(x, packed, fmt, n)
    assert torch.equal(prompt[:kernels.MAX_ROWS], full)
    for j in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11):
        assert torch.equal(_qlinear(x[:j], packed, fmt, n), full[:j])
    for i in range(kernels.MAX_ROWS):
        assert torch.equal(_qlinear(x[i:i + 1], packed, fmt, n), full[i:i + 1])
    xb = x.bfloat16()  # bfloat16 activations: read as float32, the result rounded to bfloat16 (as torch casts)
    assert torch.equal(_qlinear(xb, packed, fmt, n), _qlinear(xb.float(), packed, fmt, n).bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_float_out_holds_the_cast_outputs_bits(fmt):
    """float_out (a model's logits): float32 holding exactly what the bfloat16 output cast to float32 holds (a float32
    x: the float32 output itself), pads past lens skipped as without it; and BlockLinear's float_out is its forward's
    .float()."""
    w, x, blocks, packed = _case(fmt, 301, 136, 10, seed=3)
    xb = x.bfloat16()
    for m in (1, 5, 10):
        y = torch.ops.infer.qlinear(xb[:m], packed, BLOCK_FORMATS[fmt][0], 301, None, True)
        assert y.dtype == torch.float32 and torch.equal(y, _qlinear(xb[:m], packed, fmt, 301).float())
        assert torch.equal(torch.ops.infer.qlinear(x[:m], packed, BLOCK_FORMATS[fmt][0], 301, None, True),
                           _qlinear(x[:m], packed, fmt, 301))
    lens = torch.tensor([3, 5])  # 2 rows of 5: row 0's last two are pads
    y = torch.ops.infer.qlinear(xb, packed, BLOCK_FORMATS[fmt][0], 301, lens, True)
    ref = torch.ops.infer.qlinear(xb, packed, BLOCK_FORMATS[fmt][0], 301, lens).float()
    real = torch.tensor([0, 1, 2, 5, 6, 7, 8, 9])
    assert torch.equal(y[real], ref[real])
    lin = BlockLinear(blocks, fmt, 136, None, torch.bfloat16)
    h = xb[:6].view(2, 3, 136)
    out = lin(h, float_out=True)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 301) and torch.equal(out, lin(h).float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_qlinear_handles_zero_rows_and_blocks(fmt):
    w, x, _, _ = _case(fmt, 16, 64, 3)
    x[0] = 0  # a zero row: scale 0, no division by zero
    x[1, :32] = 0  # a zero block
    w[2] = 0
    y = _qlinear(x, pack_blocks(quantize_blocks(w, fmt), fmt), fmt, 16)
    assert torch.isfinite(y).all() and (y[0] == 0).all() and (y[:, 2] == 0).all()


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="without AVX-512 the default build is the AVX2 one, which the tests above cover")
def test_the_avx2_build_of_qlinear_is_right_and_batch_invariant_too():
    """The AVX2 build (no VNNI: vpmaddubsw, Q8_0 with llama.cpp's sign trick) in a process of its own: the same exact
    integers, hence the same bounds, and its own batch invariance."""
    run_in_the_avx2_build(
        "assert '-mavx512vnni' not in kernels._flags()\n"
        "import test_qlinear as t\n"
        "for f in t.FORMATS:\n"
        "    t.test_qlinear_is_batch_invariant(f, 301)\n"
        "    t.test_qlinear_matches_the_emulated_quantization_and_stays_within_its_bound(f, 100, True)\n"
        "    t.test_qlinear_handles_zero_rows_and_blocks(f)\n"
        "t.test_q4_k_file_blocks_pack_multiply_and_stay_batch_invariant(301, 768)\n")


def test_qlinear_rejects_bad_input():
    w, x, blocks, packed = _case("q8_0", 8, 64, 2)
    with pytest.raises(RuntimeError, match=r"unsupported block type 14 .*Q8_0 \(8\), Q4_0 \(2\), Q4_1 \(3\), Q4_K"):
        torch.ops.infer.qlinear(x, packed, 14, 8)  # Q6_K: not this kernel's
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.infer.qlinear(torch.randn(2, 20), packed, 8, 8)  # 64 columns are not 20 padded
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.infer.qlinear(x, packed, 8, 9)  # 9 rows need 2 groups of 8
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.infer.qlinear(x, packed, 2, 8)  # Q8_0 bytes read as Q4_0
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.infer.qlinear(x, packed, 12, 8)  # ... or as Q4_K (and 64 columns are no super-block)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.infer.qlinear(x, packed.float(), 8, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.infer.qlinear(x.double(), packed, 8, 8)
    with pytest.raises(ValueError, match="unknown block type 'q6_k'"):
        quantize_blocks(w, "q6_k")


def q4_k_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_K rows (gguf-py cannot quantize K-quants): random nibbles and 6-bit scales, sane float16 d/dmin."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    for lo in (0, 2):  # d, dmin
        b[..., lo:lo + 2] = rng.uniform(1e-3, 1e-2, size=(n, k // 256)).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


@pytest.mark.parametrize("n, k", [(37, 512), (8, 256), (301, 768)])
def test_q4_k_file_blocks_pack_multiply_and_stay_batch_invariant(n, k):
    """Q4_K as a GGUF stores it (super-blocks of 256: d, dmin, 6-bit sub-block scales and minimums, nibbles): the
    packing round-trips, products match gguf-py's dequantized weights against the quantized activations, and a row's
    result is the same alone or among 16."""
    blocks = q4_k_blocks(n, k, seed=n)
    packed = pack_blocks(blocks, "q4_k")
    assert torch.equal(unpack_blocks(packed, "q4_k", n), blocks)
    w = dequantize_blocks(blocks, "q4_k", k)
    assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_K)))
    x = torch.randn(kernels.MAX_ROWS, k, generator=torch.Generator().manual_seed(k))
    qx, dx = _quantize_rows(x)
    xh = (qx.view(len(x), -1, 32) * dx[..., None]).view(len(x), -1).double()
    emulated = xh @ w.double().t()
    y = _qlinear(x, packed, "q4_k", n)
    assert (y.double() - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    for i in (0, 5, 15):
        assert torch.equal(_qlinear(x[i:i + 1], packed, "q4_k", n), y[i:i + 1])
    assert torch.equal(_qlinear(x[:5], packed, "q4_k", n), y[:5])
    with pytest.raises(ValueError, match="q4_k blocks come from a GGUF file only"):
        quantize_blocks(w, "q4_k")
