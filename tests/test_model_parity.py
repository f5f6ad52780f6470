"""Our Llama against transformers' LlamaForCausalLM on the same checkpoints (float32, max abs diff <= 1e-4)."""

import pytest
import torch

from infer.cache import SlottedKVCache
from infer.model import load_model
from infer.testing import SHAPES

TOL = 1e-4


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_logits_match_transformers(ckpt_dirs, hf_model, shape):
    path = ckpt_dirs[shape]
    ours, ref = load_model(path), hf_model(path)
    ids = torch.randint(0, ours.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours.compute_logits(ours(ids))
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cached_decode_logits_match_transformers(ckpt_dirs, hf_model, shape):
    """Prefill a prompt into our KV cache, then decode token by token; every step's logits match HF's."""
    path = ckpt_dirs[shape]
    ours, ref = load_model(path), hf_model(path)
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, ours.config.vocab_size, (1, 60), generator=g)
    with torch.no_grad():
        expected = ref(seq).logits[0]  # [60, V]
    kv = SlottedKVCache.for_model(ours, 64)
    slot = kv.allocate()
    with torch.no_grad():
        meta = kv.prepare([slot], [20])
        h = ours(seq[:, :20], meta.positions, kv, meta)
        got = [ours.compute_logits(h[0, -1])]
        for t in range(20, 60):
            meta = kv.prepare([slot], [1])
            h = ours(seq[:, t:t + 1], meta.positions, kv, meta)
            got.append(ours.compute_logits(h[0, -1]))
    diff = (torch.stack(got) - expected[19:]).abs().max().item()
    assert diff <= TOL, diff


def test_multi_token_append_after_cache(ckpt_dirs, hf_model):
    """A K+1-token append on top of a cached prefix (the verification shape) matches the full forward."""
    path = ckpt_dirs["llama3"]
    ours, ref = load_model(path), hf_model(path)
    seq = torch.randint(0, ours.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(seq).logits[0]
        kv = SlottedKVCache.for_model(ours, 32)
        slot = kv.allocate()
        meta = kv.prepare([slot], [24])
        ours(seq[:, :24], meta.positions, kv, meta)
        meta = kv.prepare([slot], [6])
        got = ours.compute_logits(ours(seq[:, 24:], meta.positions, kv, meta))[0]
    assert (got - expected[24:]).abs().max().item() <= TOL


def test_batched_ragged_forward_matches_single_rows(ckpt_dirs):
    """Rows of different lengths in one padded batch give the same logits as each row alone."""
    m = load_model(ckpt_dirs["gqa"])
    g = torch.Generator().manual_seed(4)
    lens = [5, 11, 8]
    seqs = [torch.randint(0, m.config.vocab_size, (n,), generator=g) for n in lens]
    kv = SlottedKVCache.for_model(m, 32, max_slots=3)
    slots = [kv.allocate() for _ in lens]
    T = max(lens)
    x = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
    with torch.no_grad():
        meta = kv.prepare(slots, lens)
        h = m(x, meta.positions, kv, meta)
        batched = [m.compute_logits(h[i, n - 1]) for i, n in enumerate(lens)]
        # one decode step for all three rows at their own positions
        nxt = torch.tensor([[7], [8], [9]])
        meta = kv.prepare(slots, [1, 1, 1])
        step = m.compute_logits(m(nxt, meta.positions, kv, meta))[:, 0]
        for i, s in enumerate(seqs):
            full = torch.cat([s, nxt[i]])[None]
            ref = m.compute_logits(m(full))[0]
            assert (batched[i] - ref[len(s) - 1]).abs().max() <= TOL
            assert (step[i] - ref[-1]).abs().max() <= TOL
    assert [kv.seq_len(s) for s in slots] == [n + 1 for n in lens]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_runs_close_to_float32(ckpt_dirs, dtype):
    path = ckpt_dirs["llama3"]
    m32, mlow = load_model(path), load_model(path, dtype=dtype)
    assert mlow.dtype == getattr(torch, dtype)
    ids = torch.randint(0, m32.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = m32.compute_logits(m32(ids))
        b = mlow.compute_logits(mlow(ids))
    assert torch.isfinite(b).all()
    assert b.dtype == torch.float32  # logits are always float32 for sampling
    # reduced precision: close in relative terms, not bit-equal
    assert ((a - b).norm() / a.norm()).item() < 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_without_a_cache_equals_its_rows(ckpt_dirs, dtype):
    """The default positions (0..T-1, shared by the batch's rows) through every rope path: bfloat16's few-token CPU
    kernel once failed on them for more than one row."""
    m = load_model(ckpt_dirs["gqa"], dtype=dtype)
    ids = torch.randint(0, m.config.vocab_size, (3, 2), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        batch = m.compute_logits(m(ids))
        rows = torch.cat([m.compute_logits(m(ids[i:i + 1])) for i in range(3)])
    assert torch.equal(batch, rows)
