"""SlottedKVCache bookkeeping: allocation, rollback by length only, capacity, errors."""

import pytest
import torch

from infer.cache import SlottedKVCache


def make(slots=2, max_len=8):
    return SlottedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_seq_len=max_len, max_slots=slots)


def test_allocate_free_capacity():
    kv = make()
    assert kv.free_token_capacity() == 16
    a = kv.allocate()
    kv.prepare([a], [5])
    assert kv.seq_len(a) == 5 and kv.free_token_capacity() == 11
    b = kv.allocate()
    with pytest.raises(RuntimeError, match="no free KV slot"):
        kv.allocate()
    kv.free(a)
    kv.free(b)
    assert kv.free_token_capacity() == 16
    with pytest.raises(ValueError, match="not allocated"):
        kv.free(a)


def test_truncate_is_a_length_reset_and_keeps_prefix_data():
    kv = make()
    s = kv.allocate()
    meta = kv.prepare([s], [6])
    k = torch.arange(12.0).view(1, 1, 6, 2)
    kv.update(0, k, k, meta)
    before = kv.k[0].data_ptr()
    kv.truncate_to(s, 3)
    assert kv.seq_len(s) == 3 and kv.k[0].data_ptr() == before
    assert torch.equal(kv.k[0][s, 0, :3], k[0, 0, :3])  # nothing moved
    meta = kv.prepare([s], [1])
    assert meta.start == [3] and meta.kv_len == 4  # the next write lands right after the kept prefix
    with pytest.raises(ValueError, match="holds 4"):
        kv.truncate_to(s, 5)


def test_overflow_is_refused():
    kv = make(max_len=4)
    s = kv.allocate()
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        kv.prepare([s], [5])


def test_padded_rows_write_to_scratch_not_over_valid_entries():
    kv = make(slots=2, max_len=4)
    a, b = kv.allocate(), kv.allocate()
    meta = kv.prepare([a, b], [4, 1])  # row b has 3 pad queries
    k = torch.ones(2, 1, 4, 2)
    k[1] = 7.0
    kv.update(0, k, k, meta)
    assert kv.seq_len(b) == 1
    assert torch.equal(kv.k[0][b, 0, 0], torch.tensor([7.0, 7.0]))
    assert torch.equal(kv.k[0][a, 0, :4], torch.ones(4, 2))  # row a untouched by b's pads
