"""infer's CPU kernels (infer.kernels): right answers against ATen, batch invariance (a row's result does not depend on
the rows beside it, so decode and verify agree bit for bit), clear errors, and the fallback when they cannot build."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from infer import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ toolchain to build infer's kernels")

WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def _weight(wdt, n, k, gen):
    if wdt == torch.int8:
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 50
    return torch.randn(n, k, generator=gen).to(wdt), None


@pytest.mark.parametrize("wdt", WEIGHT_DTYPES)
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 100, 37, 7])  # 7 and 37: no full 8-lane block / a scalar tail
def test_linear_matches_reference(wdt, xdt, k):
    gen = torch.Generator().manual_seed(k)
    w, scale = _weight(wdt, 67, k, gen)
    x = torch.randn(kernels.MAX_ROWS, k, generator=gen).to(xdt)
    y = torch.ops.infer.linear(x, w, scale)
    assert y.dtype == xdt and y.shape == (kernels.MAX_ROWS, 67)
    ref = x.double() @ w.double().t() * (1 if scale is None else scale.double())
    tol = 1e-5 if xdt == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("wdt", WEIGHT_DTYPES)
@pytest.mark.parametrize("k", [136, 576])  # a scalar tail / whole 16-column blocks
def test_linear_is_batch_invariant(wdt, k):
    """Row i alone, among the first m rows, or among all rows: bit-identical (decode == speculative verify), whatever
    the register tile (decode and verify tile the weight rows differently; 301 rows leave remainders)."""
    gen = torch.Generator().manual_seed(0)
    w, scale = _weight(wdt, 301, k, gen)
    x = torch.randn(kernels.MAX_ROWS, k, generator=gen).to(torch.bfloat16 if wdt != torch.float32 else wdt)
    full = torch.ops.infer.linear(x, w, scale)
    for m in (1, 2, 3, 4, 5, 6, 7, 9):
        assert torch.equal(torch.ops.infer.linear(x[:m], w, scale), full[:m])
    for i in range(kernels.MAX_ROWS):
        assert torch.equal(torch.ops.infer.linear(x[i:i + 1], w, scale), full[i:i + 1])


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="without AVX-512 the default build is the AVX2 one, which the tests above cover")
def test_the_avx2_build_is_right_and_batch_invariant_too():
    """On an AVX-512 CPU the tests above run the 16-lane tiles; the AVX2 build (INFER_CPU_AVX512=0, the one every
    AVX2-only CPU gets) runs the same checks in a process of its own, and gives the same answers up to rounding."""
    run_in_the_avx2_build(
        "import test_kernels as t\n"
        "for wdt in t.WEIGHT_DTYPES:\n"
        "    for k in (136, 576): t.test_linear_is_batch_invariant(wdt, k)\n"
        "    for k in (576, 37): t.test_linear_matches_reference(wdt, torch.bfloat16, k)\n")


def run_in_the_avx2_build(code: str) -> None:
    """Run ``code`` (test calls; ``torch`` and ``kernels`` imported, tests/ importable) in a process of its own whose
    kernels are the AVX2 build (INFER_CPU_AVX512=0: other flags, so cached apart); it must finish without error."""
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from infer import kernels; assert kernels.available()\n"
            + code + "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "INFER_CPU_AVX512": "0"}, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_linear_rejects_bad_input():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.infer.linear(x, w.to(torch.int8))  # int8 without its scales
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.infer.linear(x, w, torch.ones(4))  # a scale on float weights
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.infer.linear(x.double(), w)
    with pytest.raises(RuntimeError):
        torch.ops.infer.linear(x, torch.randn(4, 9))  # K mismatch


def _qkv(dt, B=2, H=6, Hkv=2, T=4, L=29, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen).to(dt).transpose(1, 2)  # the model's layout: [B, H, T, D] view
    cache = torch.randn(2, B, L + 7, Hkv, D, generator=gen).to(dt)  # a pool larger than the live length
    k, v = (c[:, :L].transpose(1, 2) for c in cache)  # strided [B, Hkv, L, D] views, as the slotted pool hands out
    return q, k, v


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_attention_matches_sdpa(dt):
    q, k, v = _qkv(dt)
    B, T, L = q.shape[0], q.shape[2], k.shape[2]
    pos = torch.tensor([[20, 21, 22, 23], [5, 6, 7, 7]])
    mask = torch.arange(L)[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, L] causal over a cache
    mask[1, 0, 2, 3] = False  # a hole before the last visible key (padding, trees)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    for m in (mask, None):
        o = torch.ops.infer.attention(q, k, v, m)
        assert o.shape == q.shape and o.dtype == dt
        assert (o.double() - _sdpa(q, k, v, m)).abs().max() < tol
    assert o.transpose(1, 2).is_contiguous()  # stored [B, T, H, D]: the reshape to [B, T, H*D] is a view


def test_attention_decode_equals_verify():
    """A query's output alone (decode: keys up to its position, no mask) equals its row in a masked verify step."""
    q, k, v = _qkv(torch.float32)
    pos = torch.tensor([[20, 21, 22, 23], [9, 10, 11, 12]])
    mask = torch.arange(k.shape[2])[None, None, None, :] <= pos[:, None, :, None]
    verify = torch.ops.infer.attention(q, k, v, mask)
    for b in range(2):
        for t in range(4):
            p = int(pos[b, t])
            alone = torch.ops.infer.attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, :p + 1], v[b:b + 1, :, :p + 1], None)
            assert torch.equal(alone[0, :, 0], verify[b, :, t])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_attention_reads_paged_rows_in_place_with_the_same_bits(dt):
    """With ``rows`` the kernel reads each key from a paged pool's storage [R, Hkv, D] at its row: the output equals
    attending to the rows gathered into [B, Hkv, L, D] first, bit for bit, masks and holes included."""
    q, k, v = _qkv(dt)
    B, Hkv, L, D = k.shape
    g = torch.Generator().manual_seed(3)
    R = B * L + 7
    rows = torch.randperm(R, generator=g)[: B * L].view(B, L)  # scattered, as a paged pool's blocks are
    ks = torch.randn(R, Hkv, D, generator=g).to(dt)
    vs = torch.randn(R, Hkv, D, generator=g).to(dt)
    pos = torch.tensor([[20, 21, 22, 23], [5, 6, 7, 7]])
    mask = torch.arange(L)[None, None, None, :] <= pos[:, None, :, None]
    mask[1, 0, 2, 3] = False
    for m in (mask, None):
        gathered = torch.ops.infer.attention(q, ks[rows].transpose(1, 2), vs[rows].transpose(1, 2), m)
        assert torch.equal(torch.ops.infer.attention(q, ks, vs, m, rows), gathered)
    with pytest.raises(RuntimeError, match="rows must index"):
        torch.ops.infer.attention(q, ks, vs, None, rows + R)
    with pytest.raises(RuntimeError, match="rows must be int64"):
        torch.ops.infer.attention(q, ks, vs, None, rows.int())
    with pytest.raises(RuntimeError, match="3-d k, v storage"):
        torch.ops.infer.attention(q, k, v, None, rows)


@pytest.mark.parametrize("D", [24, 19, 64, 48])  # 24: a 16-lane block then an 8-lane one; 19: a scalar tail;
# 64, 48: AVX-512 builds take 16-lane scores in blocks of four keys (L = 23: three keys after the blocks)
def test_attention_query_is_the_same_in_any_group(D):
    """The kernel runs a KV head's queries in groups sharing each key load; a query's output must not depend on its
    company: alone, with its own mask row (a tree's holes included), it is bit-identical to its row in the step."""
    q, k, v = _qkv(torch.float32, B=2, H=6, Hkv=2, T=5, L=23, D=D, seed=1)
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(2, 1, 5, k.shape[2], generator=gen) < 0.7  # holes anywhere, as a token tree's ancestors
    mask[..., 0] = True
    verify = torch.ops.infer.attention(q, k, v, mask)
    assert (verify.double() - _sdpa(q, k, v, mask)).abs().max() < 1e-5
    for b in range(2):
        for t in range(5):
            alone = torch.ops.infer.attention(q[b:b + 1, :, t:t + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1, :, t:t + 1])
            assert torch.equal(alone[0, :, 0], verify[b, :, t])


@pytest.mark.parametrize("B, T", [(1, 1), (1, 2), (2, 1), (2, 5)])
def test_attention_is_the_same_on_any_number_of_threads(B, T):
    """Each thread takes a contiguous range of the step's queries, cut into groups that never cross a KV head: the
    split moves with the thread count (and a KV head's queries may be shared by two threads), the bits must not."""
    q, k, v = _qkv(torch.bfloat16, B=B, H=9, Hkv=3, T=T, L=300, D=64, seed=3)
    mask = torch.ones(B, 1, T, k.shape[2], dtype=torch.bool)
    for t in range(T):
        mask[:, 0, t, k.shape[2] - T + t + 1:] = False
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(torch.ops.infer.attention(q, k, v, mask))
    finally:
        torch.set_num_threads(threads)
    assert (outs[0].double() - _sdpa(q, k, v, mask)).abs().max() < 0.05
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_attention_with_holes_equals_the_visible_keys_alone(dt):
    """A token tree's node sees its ancestors' keys with its other nodes' keys masked between them; as a chain the
    same keys are contiguous. The node's output must be bit-identical to the chain's (tests/test_trees.py relies on
    it): no sum may group the keys by their index in the cache."""
    q, k, v = _qkv(dt, B=1, H=6, Hkv=2, T=1, L=41, D=64, seed=3)
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        mask = torch.rand(1, 1, 1, k.shape[2], generator=gen) < 0.5
        mask[..., 0] = True
        keep = mask[0, 0, 0].nonzero().flatten()
        holes = torch.ops.infer.attention(q, k, v, mask)
        chain = torch.ops.infer.attention(q, k[:, :, keep], v[:, :, keep], None)
        assert torch.equal(holes, chain), seed


def test_attention_query_that_sees_nothing_is_zero_not_nan():
    q, k, v = _qkv(torch.float32, B=1, T=2)
    mask = torch.zeros(1, 1, 2, k.shape[2], dtype=torch.bool)
    mask[0, 0, 1, :3] = True
    o = torch.ops.infer.attention(q, k, v, mask)
    assert torch.equal(o[0, :, 0], torch.zeros_like(o[0, :, 0]))
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_wide_batches_decode_through_the_kernel(gqa_dir, monkeypatch, backend):
    """A decode step's attention takes infer's kernel whatever the batch (its bound is the tokens a row brings, not the
    rows): 20 rows (more than kernels.MAX_ROWS) decode with ATen's SDPA made to fail after their prefill, and each
    row's attention output is the one it gets decoding alone (to rounding: 20 rows' q, k and v come from ATen's GEMM,
    one row's from infer::linear; the kernel itself is batch-invariant, test_attention_decode_equals_verify). The paged
    pool's rows are fed a token at a time in turn, so their blocks interleave: the kernel reads them in place."""
    from infer.cache.paged import PagedKVCachePool
    from infer.cache.slotted import SlottedKVCache
    from infer.model import layers
    from infer.model.loader import load_model

    model = load_model(gqa_dir)
    cfg, n = model.config, kernels.MAX_ROWS + 4
    pool = SlottedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, n, model.dtype) \
        if backend == "slotted" else PagedKVCachePool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                                      4 * n, block_size=2, max_seq_len=32, max_slots=n,
                                                      dtype=model.dtype)
    prompts = [[3 + i, 5 + i, 7 + 2 * i][: 1 + i % 3] for i in range(n)]  # unequal lengths: padding masks
    slots = [pool.allocate(32) for _ in range(n)]
    calls: dict[int, list] = {}  # rows -> the kernel's outputs, layer by layer
    in_place: list[bool] = []  # whether each call read a paged pool's storage in place
    kernel = torch.ops.infer.attention

    def recorded(q, k, v, mask=None, rows=None, lens=None):
        o = kernel(q, k, v, mask, rows, lens)
        calls.setdefault(q.shape[0], []).append(o)
        in_place.append(rows is not None)
        return o

    def plan(slots, num_new):
        meta = pool.prepare(slots, num_new, torch.device("cpu"))
        return meta.positions, pool, meta

    with torch.inference_mode():
        for t in range(3):  # a token at a time, row after row
            for s, p in zip(slots, prompts):
                if t < len(p):
                    model(torch.tensor([p[t:t + 1]]), *plan([s], [1]))
        monkeypatch.setattr(layers.F, "scaled_dot_product_attention", _no_sdpa)
        monkeypatch.setattr(torch.ops.infer, "attention", recorded)
        x = torch.tensor([[1 + i] for i in range(n)])
        model(x, *plan(slots, [1] * n))
        wide = calls.pop(n)[0]  # layer 0, [n, H, 1, D]
        assert len(calls) == 0 and all(in_place) == (backend == "paged") and in_place
        for i, s in enumerate(slots):  # each row alone, at the same position over the same cache
            pool.truncate_to(s, len(prompts[i]))
            model(x[i:i + 1], *plan([s], [1]))
            torch.testing.assert_close(calls.pop(1)[0][0], wide[i], rtol=1e-5, atol=1e-5)


def _no_sdpa(*a, **k):
    raise AssertionError("a decode step fell back to ATen's scaled_dot_product_attention")


def test_attention_rejects_bad_shapes():
    q, k, v = _qkv(torch.float32, H=5, Hkv=2)  # 5 query heads cannot share 2 KV heads
    with pytest.raises(RuntimeError):
        torch.ops.infer.attention(q, k, v, None)


# a prompt's rows: more than rows.h's kParallelRows (32), so the row-wise kernels share them out over the threads
PREFILL_ROWS = 70


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [576, 64, 37])  # 37: a tail shorter than the 16 partial sums
def test_rms_norm_matches_reference_and_is_batch_invariant(dt, h):
    """infer::rms_norm (kernels/norm.cpp): Hugging Face's math and rounding, and each row's bits independent of the
    rows beside it, so a step computes the same norm alone or in a batch, eager or compiled."""
    gen = torch.Generator().manual_seed(h)
    x = (torch.randn(PREFILL_ROWS, h, generator=gen) * 3).to(dt)
    w = (1 + torch.randn(h, generator=gen) / 10).to(dt)
    y = torch.ops.infer.rms_norm(x, w, 1e-5)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = normed * w.float() if dt == torch.float32 else (w * normed.to(dt)).float()
    tol = 1e-5 if dt == torch.float32 else 1e-2
    assert y.dtype == dt and (y.float() - ref).abs().max() <= tol * ref.abs().max()
    for i in range(x.shape[0]):
        assert torch.equal(torch.ops.infer.rms_norm(x[i:i + 1], w, 1e-5), y[i:i + 1])


@pytest.mark.parametrize("h", [576, 64, 37])
def test_rms_norm_bfloat16_is_exactly_its_documented_order(h):
    """infer::rms_norm in bfloat16, bit for bit the math kernels/norm.cpp documents: 16 partial sums of squares (lane
    l: the elements l, l + 16, .. in order, a multiply then an add), summed left to right, r = 1 / sqrt(sum / n +
    eps), y = bf16(w * bf16(x * r)). The AVX-512 build's 16-lane body and the scalar loops must both be this."""
    gen = torch.Generator().manual_seed(h + 1)
    x = (torch.randn(5, h, generator=gen) * 3).bfloat16()
    w = (1 + torch.randn(h, generator=gen) / 10).bfloat16()
    y = torch.ops.infer.rms_norm(x, w, 1e-5)
    for m in range(x.shape[0]):
        xf = x[m].float()
        part = torch.zeros(16)
        full = h // 16 * 16
        for i in range(0, full, 16):
            part = part + xf[i:i + 16] * xf[i:i + 16]
        tail = xf[full:]
        part[:len(tail)] = part[:len(tail)] + tail * tail
        total = torch.zeros((), dtype=torch.float32)
        for lane in range(16):
            total = total + part[lane]
        r = torch.ones(()) / torch.sqrt(total / torch.tensor(float(h)) + torch.tensor(1e-5))
        ref = (w.float() * (xf * r).bfloat16().float()).bfloat16()
        assert torch.equal(y[m], ref)


def test_rms_norm_rejects_bad_input():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.infer.rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.infer.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.infer.rms_norm(x.half(), w.half(), 1e-5)
    with pytest.raises(RuntimeError, match="rows, hidden"):
        torch.ops.infer.rms_norm(x[None], w, 1e-5)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [(15, 64), (3, 6)])  # 6: half a head shorter than the 8-lane vector body
def test_rope_is_one_rounding_of_the_float32_math_and_batch_invariant(dt, heads, d):
    """infer::rope (kernels/pointwise.cpp): x cos + rotate_half(x) sin in float32, rounded once to x's dtype (float32:
    exactly ATen's ops), rows independent of each other; reads the first heads of a strided row (the qkv product)."""
    gen = torch.Generator().manual_seed(heads)
    M = PREFILL_ROWS
    qkv = (torch.randn(M, (heads + 2) * d, generator=gen) * 4).to(dt)
    cos, sin = torch.randn(M, d, generator=gen).to(dt), torch.randn(M, d, generator=gen).to(dt)
    y = torch.ops.infer.rope(qkv, cos, sin, heads, d)
    x = qkv.float()[:, :heads * d].view(M, heads, d)
    x1, x2 = x.chunk(2, -1)
    ref = x * cos.float()[:, None] + torch.cat((-x2, x1), -1) * sin.float()[:, None]
    assert y.dtype == dt and torch.equal(y, ref.view(M, -1).to(dt))
    for i in range(M):
        assert torch.equal(torch.ops.infer.rope(qkv[i:i + 1], cos[i:i + 1], sin[i:i + 1], heads, d), y[i:i + 1])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1536, 1000, 13])  # 13: the scalar tail only; 1000: pieces of 500 (tails inside)
def test_silu_mul_is_one_rounding_of_the_float32_math_and_batch_invariant(dt, n):
    """infer::silu_mul: silu(gate) * up in float32 (its own exp: within a few ulp of ATen's), rounded once; the
    vector body and the scalar tail agree, rows are independent of each other (a lone row runs on one thread, many
    rows in pieces over the threads); extremes stay finite."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(PREFILL_ROWS, 2 * n, generator=gen) * 4).to(dt)
    x[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0]).to(dt)
    y = torch.ops.infer.silu_mul(x)
    ref = F.silu(x.float()[:, :n]) * x.float()[:, n:]
    assert y.dtype == dt and torch.isfinite(y.float()).all()
    assert ((y.float() - ref).abs() <= 2e-6 * ref.abs() + (2 ** -7) * ref.abs() * (dt == torch.bfloat16) + 1e-30).all()
    for i in range(x.shape[0]):
        assert torch.equal(torch.ops.infer.silu_mul(x[i:i + 1]), y[i:i + 1])
    # the vector body (8 lanes) and the scalar tail compute the same function: a row shifted by a few columns
    shifted = torch.ops.infer.silu_mul(torch.cat([x[:1, 3:n], x[:1, n + 3:]], -1))
    assert torch.equal(shifted, y[:1, 3:])


def test_pointwise_kernels_reject_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        torch.ops.infer.rope(x, torch.randn(2, 4), torch.randn(2, 2), 2, 4)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.infer.rope(x, torch.randn(2, 4), torch.randn(2, 4), 3, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.infer.silu_mul(x.half())
    with pytest.raises(RuntimeError, match=r"rows, 2 \* n"):
        torch.ops.infer.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 49152), (2, 5, 8192), (3, 7), (5, 1), (2, 64), (2, 65), (3, 200)])
def test_argmax_is_torchs_first_maximum(dt, shape):
    """infer::argmax answers what torch.argmax does: the first maximum on ties (many of them, or a maximum in several
    blocks of 64), the first NaN where a row holds one, 0 for a row of -inf; any length (vector blocks and a tail)."""
    g = torch.Generator().manual_seed(sum(shape))
    rows = [torch.randn(*shape, generator=g), torch.randn(*shape, generator=g).mul(2).round(),
            (torch.randn(*shape, generator=g) > 1.0).float(), torch.full(shape, float("-inf")),
            torch.zeros(shape).index_fill_(-1, torch.tensor([0, shape[-1] - 1]), -0.0), torch.full(shape, float("inf"))]
    late = torch.randn(*shape, generator=g)
    late[..., -1] = 10.0  # the maximum in the tail, after every block
    nan = torch.randn(*shape, generator=g)
    nan.view(-1)[nan.numel() // 2] = float("nan")
    for x in [*rows, late, nan]:
        x = x.to(dt)
        assert torch.equal(torch.ops.infer.argmax(x), x.argmax(-1)), x
    wide = torch.randn(shape[0], 2 * shape[-1], generator=g).to(dt)[:, ::2]  # not contiguous
    assert torch.equal(torch.ops.infer.argmax(wide), wide.argmax(-1))


def test_argmax_is_what_greedy_decoding_calls_and_rejects_bad_input():
    from infer.sampling import argmax

    x = torch.randn(3, 49152)
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x.half()), x.half().argmax(-1))  # no kernel for float16: ATen's answer
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.infer.argmax(x.double())
    with pytest.raises(RuntimeError, match="last dimension is empty"):
        torch.ops.infer.argmax(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="needs a last dimension"):
        torch.ops.infer.argmax(torch.tensor(1.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", [None, "int8", "q4_1"])
@pytest.mark.parametrize("B,T", [(8, 3), (3, 9), (20, 1)])  # B x T past MAX_ROWS; 20: a decode wider than it
def test_a_batch_decode_and_its_verify_give_each_row_the_same_bits(dtype, kind, B, T):
    """What batched greedy speculation's parity rests on: a row's first verify position equals its decode step, with
    every other row of the batch beside it, whatever B x T (the kernels gate on tokens a row, not rows in all)."""
    from infer.engine import Engine, EngineConfig
    from infer.model.quant import quantize_model
    from infer.testing import random_llama

    model = random_llama(64, seed=0, hidden_size=64).to(getattr(torch, dtype))
    if kind:
        model = quantize_model(model, kind)
    eng = Engine(EngineConfig(model="t", block_size=4, max_batch_size=B, dtype=dtype, quantization=kind), model=model)
    runner, pool = eng.runner, eng.kv.pool
    with torch.inference_mode():
        slots = [pool.allocate(40) for _ in range(B)]
        runner.forward(runner.model, pool, slots, [[(3 * i + j) % 60 + 1 for j in range(5 + i % 7)] for i in range(B)])
        lens = [pool.seq_len(s) for s in slots]
        decode = runner.forward(runner.model, pool, slots, [[5]] * B)  # [B, 1, H]
        for s, n in zip(slots, lens):
            pool.truncate_to(s, n)
        verify = runner.forward(runner.model, pool, slots, [[5] + [7] * (T - 1)] * B)  # [B, T, H]
        assert torch.equal(decode[:, 0], verify[:, 0])
        assert torch.equal(runner.model.compute_logits(decode), runner.model.compute_logits(verify)[:, :1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_a_prompt_gets_the_same_bits_prefilled_whole_in_chunks_or_token_by_token(dtype, kind, backend):
    """Every CPU step runs on infer's row-wise kernels, a prefill's too (layers.kernels_take), and the block products
    are batch-invariant: so a prompt's states do not depend on how it is fed. One forward of 45 tokens (past MAX_ROWS
    and past rows.h's cut where rows go over the threads), chunks of 7 (chunked prefill, a prefix-cache hit's
    remainder) and one token a step (decode) give every position the same hidden state and logits, bit for bit."""
    from infer.engine import Engine, EngineConfig
    from infer.model.quant import quantize_model
    from infer.testing import random_llama

    model = quantize_model(random_llama(64, seed=3, hidden_size=64, num_layers=3).to(getattr(torch, dtype)), kind)
    eng = Engine(EngineConfig(model="t", block_size=4, max_batch_size=3, dtype=dtype, quantization=kind,
                              kv_cache_backend=backend), model=model)
    runner, pool = eng.runner, eng.kv.pool
    prompt = [(7 * j) % 61 + 1 for j in range(45)]
    with torch.inference_mode():
        whole, chunked, stepped = (pool.allocate(48) for _ in range(3))
        ref = runner.forward(runner.model, pool, [whole], [prompt])[0]  # [45, H]
        by_chunk = torch.cat([runner.forward(runner.model, pool, [chunked], [prompt[i:i + 7]])[0]
                              for i in range(0, len(prompt), 7)])
        by_token = torch.cat([runner.forward(runner.model, pool, [stepped], [[t]])[0] for t in prompt])
        assert torch.equal(by_chunk, ref) and torch.equal(by_token, ref)
        logits = runner.model.compute_logits(ref[None])
        assert torch.equal(runner.model.compute_logits(by_token[None]), logits) and torch.isfinite(logits).all()


def test_models_use_the_kernels_and_fall_back_without_them(gqa_dir):
    """The same greedy tokens with the kernels and with INFER_CPU_KERNELS=0 (ATen), on a float32 tiny model."""
    script = ("import sys, json, torch; torch.set_num_threads(1)\n"
              "from infer import LLM, SamplingParams, kernels\n"
              "out = LLM(sys.argv[1], compile=False).generate(['def f(x):', 'The cat'], "
              "SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))\n"
              "print(json.dumps([kernels.available(), [o.token_ids for o in out]]))\n")
    runs = {}
    for flag in ("1", "0"):
        env = {**os.environ, "INFER_CPU_KERNELS": flag}
        res = subprocess.run([sys.executable, "-c", script, str(gqa_dir)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        runs[flag] = json.loads(res.stdout.strip().splitlines()[-1])
    assert runs["1"][0] is True and runs["0"][0] is False
    assert runs["1"][1] == runs["0"][1]


def test_build_failure_warns_and_falls_back(monkeypatch):
    def broken():
        raise RuntimeError("c++: not found")

    monkeypatch.setattr(kernels, "_build", broken)
    monkeypatch.setattr(kernels, "_loaded", None)
    with pytest.warns(RuntimeWarning, match="could not be built.*c\\+\\+: not found"):
        assert kernels.available() is False
    from infer.model.layers import few_rows_on_cpu

    assert not few_rows_on_cpu(torch.randn(1, 8))  # every product goes to ATen


def test_pads_past_lens_are_skipped_and_the_real_rows_keep_their_bits():
    """kernels/rows.h: with ``lens`` ([B]) a padded [B, T] call works on row b's tokens t < lens[b] alone (a verify
    whose rows draft unequal K). The real rows' bits are the call's without lens, whatever the pads hold (NaN here:
    a kernel that read them would spread it), and attention gives the pads zeros; bad lens are named."""
    from infer.model.quant import BlockLinear, Int8Linear

    gen = torch.Generator().manual_seed(7)
    B, T, K, N = 3, 5, 96, 72
    lens = torch.tensor([5, 2, 1])
    real = (torch.arange(T)[None, :] < lens[:, None]).reshape(-1)  # [B * T]
    w = torch.randn(N, K, generator=gen)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(B * T, K, generator=gen).to(dt)
        poisoned = x.clone()
        poisoned[~real] = float("nan")
        products = {"linear": lambda x, lens: torch.ops.infer.linear(x, w.to(dt), None, lens),
                    "int8": lambda x, lens, m=Int8Linear(w, None, dt): m(x, lens)}
        for fmt in ("q4_1", "q8_0", "q4_0"):
            products[fmt] = lambda x, lens, m=BlockLinear.quantize(w, None, dt, fmt): m(x, lens)
        for name, f in products.items():
            full, part = f(x, None), f(poisoned, lens)
            assert part.shape == full.shape and torch.equal(part[real], full[real]), (name, dt)
        nw = (1 + torch.randn(K, generator=gen) / 10).to(dt)
        full, part = torch.ops.infer.rms_norm(x, nw, 1e-5), torch.ops.infer.rms_norm(poisoned, nw, 1e-5, lens)
        assert torch.equal(part[real], full[real])
        gu = torch.randn(B * T, 2 * K, generator=gen).to(dt)
        gp = gu.clone()
        gp[~real] = float("nan")
        assert torch.equal(torch.ops.infer.silu_mul(gp, lens)[real], torch.ops.infer.silu_mul(gu)[real])
        cos, sin = (torch.randn(B * T, 16, generator=gen).to(dt) for _ in range(2))
        assert torch.equal(torch.ops.infer.rope(poisoned, cos, sin, 4, 16, lens)[real],
                           torch.ops.infer.rope(x, cos, sin, 4, 16)[real])
        q, k, v = _qkv(dt, B=B, H=4, Hkv=2, T=T, L=12)
        base = q.transpose(1, 2).clone()  # [B, T, H, D]
        base.view(B * T, -1)[~real] = float("nan")
        qp = base.transpose(1, 2)
        mask = torch.ones(B, 1, T, 12, dtype=torch.bool)
        full, part = torch.ops.infer.attention(q, k, v, mask), torch.ops.infer.attention(qp, k, v, mask, None, lens)
        full, part = (o.transpose(1, 2).reshape(B * T, -1) for o in (full, part))
        assert torch.equal(part[real], full[real]) and (part[~real] == 0).all()
    with pytest.raises(RuntimeError, match="lens"):
        torch.ops.infer.linear(x, w.to(x.dtype), None, torch.tensor([1, 2]))  # 2 rows do not divide 15
    with pytest.raises(RuntimeError, match="lens"):
        torch.ops.infer.rms_norm(x, nw, 1e-5, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_ragged_forward_gives_each_row_its_bits_and_zero_logits_at_the_pads(gqa_dir, compiled):
    """A verify of rows with unequal tokens (attn_meta.lens, set by the pool for every forward of T > 1): each row's
    hidden states and logits are bit-identical to its forward alone, and the logits of its pads are 0 (the kernels
    leave them unwritten; a round's batched verification reads finite values). Compiled too (the forward's graph;
    the head, compiled on CUDA only, has its pads zeroed after it, where a row has some: compute_logits)."""
    from infer.cache.slotted import SlottedKVCache
    from infer.model.compile import compile_model
    from infer.model.loader import load_model

    model = load_model(gqa_dir)
    if compiled:
        compile_model(model)
    cfg = model.config
    pool = SlottedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, 3, model.dtype)
    prompts, rows = [[3, 5, 7], [4, 6], [9, 2, 8, 1]], [[11, 12, 13, 14], [15], [16, 17]]
    slots = [pool.allocate(32) for _ in prompts]
    with torch.inference_mode():
        for s, p in zip(slots, prompts):
            meta = pool.prepare([s], [len(p)])
            model(torch.tensor([p]), meta.positions, pool, meta)
        meta = pool.prepare(slots, [len(r) for r in rows])
        assert meta.lens.tolist() == [4, 1, 2]
        x = torch.tensor([r + [0] * (4 - len(r)) for r in rows])
        hidden = model(x, meta.positions, pool, meta)
        logits = model.compute_logits(hidden, meta.lens)
        for i, (s, p, r) in enumerate(zip(slots, prompts, rows)):
            pool.truncate_to(s, len(p))
            alone = pool.prepare([s], [len(r)])
            h = model(torch.tensor([r]), alone.positions, pool, alone)
            assert torch.equal(hidden[i, :len(r)], h[0])
            assert torch.equal(logits[i, :len(r)], model.compute_logits(h, alone.lens)[0])
            assert (logits[i, len(r):] == 0).all()
