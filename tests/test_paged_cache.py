"""PagedKVCachePool: same attention results as the contiguous pool, rollback frees whole trailing blocks (D6),
prefix cache sharing and eviction, capacity accounting."""

import pytest
import torch

from infer.cache import PagedKVCachePool, SlottedKVCache
from infer.testing import random_llama


@pytest.fixture(scope="module")
def model():
    return random_llama(vocab_size=50, seed=1)


def _run(model, pool, seqs):
    """Chunked prefill of three sequences, a rollback, then a batched decode; returns logits of both phases."""
    slots = [pool.allocate() for _ in seqs]
    outs = []
    for lo, hi in ((0, 4), (4, None)):
        rows = [s[lo:hi] for s in seqs]
        x = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, :len(r)] = torch.tensor(r)
        meta = pool.prepare(slots, [len(r) for r in rows])
        h = model(x, meta.positions, pool, meta)
    outs.append(model.compute_logits(torch.stack([h[i, len(r) - 1] for i, r in enumerate(rows)])))
    pool.truncate_to(slots[1], pool.seq_len(slots[1]) - 3)
    meta = pool.prepare(slots, [1, 1, 1])
    outs.append(model.compute_logits(model(torch.tensor([[1], [2], [3]]), meta.positions, pool, meta)[:, -1]))
    return outs, slots


def test_paged_attention_matches_contiguous_and_reference(model):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (5, 13, 9)]
    ref, _ = _run(model, SlottedKVCache.for_model(model, 64, 3), seqs)
    paged, slots = _run(model, PagedKVCachePool.for_model(model, 20, 4, 64, 3), seqs)
    for a, b in zip(ref, paged):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    full = torch.cat([model.compute_logits(model(torch.tensor([s]))[:, -1]) for s in seqs])
    torch.testing.assert_close(paged[0], full, rtol=1e-5, atol=1e-5)


def test_truncate_frees_whole_trailing_blocks_only():
    pool = PagedKVCachePool(1, 1, 4, num_blocks=8, block_size=4, max_seq_len=32, max_slots=2)
    s = pool.allocate()
    pool.prepare([s], [10])  # 3 blocks
    assert pool.free_token_capacity() == 5 * 4
    pool.truncate_to(s, 9)  # still 3 blocks (partial last block is kept)
    assert pool.free_token_capacity() == 5 * 4
    pool.truncate_to(s, 8)  # block 3 freed
    assert pool.free_token_capacity() == 6 * 4 and pool.seq_len(s) == 8
    pool.truncate_to(s, 0)
    assert pool.free_token_capacity() == 8 * 4
    with pytest.raises(ValueError, match="truncate_to"):
        pool.truncate_to(s, 1)  # cannot grow by truncation
    pool.free(s)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(s)


def test_a_lone_sequence_gets_consecutive_blocks_after_interleaved_ones():
    """Blocks go lowest first, so once interleaved sequences leave, the next one's blocks are consecutive again and
    attention reads them as one slice (row0), not through a gather of the whole cache."""
    pool = PagedKVCachePool(1, 1, 4, num_blocks=16, block_size=4, max_seq_len=64, max_slots=3)
    a, b = pool.allocate(), pool.allocate()
    for _ in range(4):  # a and b grow in turns: a holds blocks 0, 2, 4, 6 and b 1, 3, 5, 7
        pool.prepare([a, b], [4, 4])
    assert pool.prepare([a], [1]).row0 is None  # a's blocks are not consecutive: the gather path
    pool.free(a)
    pool.free(b)
    c = pool.allocate()
    pool.prepare([c], [30])
    meta = pool.prepare([c], [1])
    assert meta.row0 == 0 and meta.kv_len == 31


def test_a_run_of_steps_shares_one_layout_and_addresses_what_single_steps_address():
    """prepare_run (a draft chain's plans): a lone row whose run crosses into a block that is not next to its last
    reads every step through storage rows, the steps before the gap too (one layout: one compiled graph), and
    writes and reads the same storage rows as single steps would; a run within consecutive blocks keeps slices."""
    pool = PagedKVCachePool(1, 1, 4, num_blocks=16, block_size=4, max_seq_len=64, max_slots=3)
    a, b = pool.allocate(), pool.allocate()
    pool.prepare([a], [6])  # blocks 0, 1
    pool.prepare([b], [4])  # block 2: a's next block will be 3, not next to 1
    single = [pool.prepare([a], [1]) for _ in range(3)]  # positions 6, 7 in block 1; 8 in block 3
    assert [m.row0 is None for m in single] == [False, False, True]
    pool.truncate_to(a, 6)
    run = pool.prepare_run([a], 3)
    assert all(m.row0 is None for m in run) and pool.seq_len(a) == 9
    for one, m in zip(single, run):
        rows = one.row0 + one.write_pos if one.row0 is not None else one.write_pos
        assert torch.equal(m.write_pos, rows) and m.kv_len == one.kv_len
        assert torch.equal(m.read_pos[0], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 12][:m.kv_len]))
    pool.truncate_to(a, 2)
    assert all(m.row0 == 0 for m in pool.prepare_run([a], 3))  # blocks 0 and 1, consecutive: slices throughout


def test_can_fit_asks_before_prepare_does():
    pool = PagedKVCachePool(1, 1, 4, num_blocks=4, block_size=4, max_seq_len=32, max_slots=2)
    s = pool.allocate()
    assert pool.can_fit([(s, 16)]) and not pool.can_fit([(s, 17)])
    assert not pool.can_fit([(s, 12), (None, 5)])  # 3 + 2 blocks > 4
    assert not pool.can_fit([(None, 1), (None, 1)])  # one slot left
    pool.prepare([s], [16])
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.prepare([s], [1])
    assert pool.seq_len(s) == 16  # a refused prepare changes nothing


def test_prefix_cache_shares_full_prompt_blocks_and_evicts_lru(model):
    pool = PagedKVCachePool.for_model(model, num_blocks=6, block_size=4, max_seq_len=32, max_slots=3,
                                      enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    a = pool.allocate(prefix_ids=prompt)
    assert pool.seq_len(a) == 0
    meta = pool.prepare([a], [10])
    ha = model(torch.tensor([prompt]), meta.positions, pool, meta)
    pool.cache_prefix(a, prompt)
    b = pool.allocate(prefix_ids=prompt + [7, 7])  # shares the 2 full blocks
    assert pool.seq_len(b) == 8
    meta = pool.prepare([b], [2])
    hb = model(torch.tensor([prompt[8:]]), meta.positions, pool, meta)
    torch.testing.assert_close(hb[0, -1], ha[0, -1], rtol=1e-5, atol=1e-5)
    assert pool.free_token_capacity() == (6 - 3 - 1) * 4  # a: 3 blocks, b: 2 shared + 1 own
    pool.free(a)
    pool.free(b)
    assert pool.free_token_capacity() == 6 * 4  # cached blocks count as free (evictable)
    c = pool.allocate(prefix_ids=prompt)
    assert pool.seq_len(c) == 8  # still cached after both owners left
    pool.free(c)
    d = pool.allocate()
    pool.prepare([d], [24])  # needs every block: evicts the cached ones
    pool.free(d)
    e = pool.allocate(prefix_ids=prompt)
    assert pool.seq_len(e) == 0  # evicted
    # a prompt that is exactly whole blocks never hits entirely: its last token must be recomputed
    pool.free(e)


def test_whole_prompt_never_hits():
    pool = PagedKVCachePool(1, 1, 4, num_blocks=8, block_size=4, max_seq_len=32, max_slots=2,
                            enable_prefix_caching=True)
    prompt = list(range(8))
    a = pool.allocate(prefix_ids=prompt)
    pool.prepare([a], [8])
    pool.cache_prefix(a, prompt)
    b = pool.allocate(prefix_ids=prompt)
    assert pool.seq_len(b) == 4


def test_reset_prefix_cache_forgets_hits_and_frees_cached_blocks(model):
    pool = PagedKVCachePool.for_model(model, num_blocks=6, block_size=4, max_seq_len=32, max_slots=3,
                                      enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 2 full blocks + 2
    a = pool.allocate(prefix_ids=prompt)
    meta = pool.prepare([a], [10])
    model(torch.tensor([prompt]), meta.positions, pool, meta)
    pool.cache_prefix(a, prompt)
    b = pool.allocate(prefix_ids=prompt)
    assert pool.seq_len(b) == 8
    pool.free(b)
    assert pool.reset_prefix_cache() == 2
    assert pool.reset_prefix_cache() == 0
    c = pool.allocate(prefix_ids=prompt)
    assert pool.seq_len(c) == 0  # forgotten: computed again
    pool.free(c)
    # the slot that computed the blocks keeps them, unchanged: its next token sees the same keys
    meta = pool.prepare([a], [1])
    h = model(torch.tensor([[3]]), meta.positions, pool, meta)
    ref = PagedKVCachePool.for_model(model, num_blocks=6, block_size=4, max_seq_len=32, max_slots=1)
    r = ref.allocate()
    meta = ref.prepare([r], [11])
    torch.testing.assert_close(h[0, -1], model(torch.tensor([prompt + [3]]), meta.positions, ref, meta)[0, -1])
    pool.free(a)  # uncached now: its blocks go back to the free list, not to the evictable set
    assert pool.free_token_capacity() == 6 * 4 and not pool._evictable
    d = pool.allocate()
    pool.prepare([d], [24])  # every block, from the free list alone
    assert pool.seq_len(d) == 24


def test_extend_takes_blocks_and_addresses_positions_as_prepare_does():
    """``extend`` (a caller that addresses storage itself: Eagle3Head.native_round) takes the blocks and length that
    ``prepare`` would, and ``block_table`` maps position p to the storage row a plan writes it to; too long or too
    many is refused with prepare's errors, nothing taken."""
    pool = PagedKVCachePool(1, 1, 2, num_blocks=6, block_size=4, max_seq_len=16, max_slots=2)
    a, b = pool.allocate(), pool.allocate()
    pool.prepare([a], [3])
    pool.prepare([b], [5])
    assert pool.extend(a, 6) == 3 and pool.seq_len(a) == 9
    table = pool.block_table(a)
    rows = [int(table[p // 4]) * 4 + p % 4 for p in range(9)]
    pool.truncate_to(a, 3)
    meta = pool.prepare([a], [6])  # a's blocks are not consecutive (b's lie between): written through storage rows
    assert meta.row0 is None and meta.write_pos[0].tolist() == rows[3:]
    free = pool.num_free_blocks
    with pytest.raises(ValueError, match="max_seq_len"):
        pool.extend(a, 8)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.extend(b, 11)
    assert pool.num_free_blocks == free and pool.seq_len(a) == 9 and pool.seq_len(b) == 5


def test_storage_rows_are_the_rows_a_plan_reads():
    """``storage_rows`` (LlamaForCausalLM.native_step addresses keys through it) gives the storage row of every position
    a ``prepare``'d plan reads: a range on consecutive blocks, the block table's rows on interleaved ones."""
    pool = PagedKVCachePool(1, 1, 2, num_blocks=8, block_size=4, max_seq_len=24, max_slots=2)
    a, b = pool.allocate(), pool.allocate()
    pool.prepare([a], [6])
    meta = pool.prepare([a], [1])  # a's two blocks are consecutive: the plan reads a slice from row0
    assert meta.row0 is not None and pool.storage_rows(a, 7).tolist() == list(range(meta.row0, meta.row0 + 7))
    pool.prepare([b], [5])
    meta = pool.prepare([a], [3])  # a's third block comes after b's: rows through the table
    assert meta.row0 is None and pool.storage_rows(a, 10).tolist() == meta.read_pos[0].tolist()
    assert pool.storage_rows(a, 10).tolist()[:8] == list(range(meta.read_pos[0][0], meta.read_pos[0][0] + 8))
