"""A draft LM's round in one C++ call (kernels/lm_round.cpp, DraftModelProposer._round): the module's steps' drafts,
laws and cache entries; greedy parity and the exact joint law through an engine whose lone rows draft that way."""

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.proposers.draft_model import DraftModelProposer
from infer.proposers.draft_vocab import DraftVocab, PromptVocabs
from infer.sampling import SamplingParams
from infer.generate import autoregressive_generate
from infer.speculative import speculative_generate
from infer.testing import random_llama

from test_draft_heads import reference_draw
from test_spec_distribution import N, V, chi2_pvalue, exact_joint


def _quantized_lm(vocab: int, seed: int, **kw):
    """A bfloat16 draft LM in Q8_0 blocks (what an engine's draft_quantization makes of it over a quantized target)."""
    from infer.model.quant import quantize_model

    return quantize_model(random_llama(vocab, seed=seed, **kw).to(torch.bfloat16), "q8_0")


@pytest.fixture
def counted(monkeypatch):
    """The one-call rounds run, counted."""
    calls = []
    orig = DraftModelProposer._round
    monkeypatch.setattr(DraftModelProposer, "_round", lambda *a: calls.append(1) or orig(*a))
    return calls


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("catch_up,steps", [(1, 1), (3, 4), (6, 2)])
def test_a_lone_rows_round_in_one_cpp_call_gives_the_module_steps_drafts(catch_up, steps, sampled):
    """The op against the drafter's own steps (its forward, then the draft vocabulary's scores: quantized rows and the
    prompt's tokens added unquantized): the same drafts, the same laws q (to the exp's last bits) and the same keys
    and values in every layer, written to the same storage rows of a paged pool whose blocks are not consecutive."""
    from infer.cache.paged import PagedKVCachePool

    lm = _quantized_lm(96, seed=1, hidden_size=64, num_layers=3)
    c = lm.config
    dv = PromptVocabs.widened(DraftVocab(lm.lm_head_weight, range(0, 96, 2)).quantized("q8_0").including([7, 9]))
    assert dv.extra_weight is not None and dv.extra_weight.shape[0] == 2  # rows beside the quantized ones
    pool = PagedKVCachePool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32, 4, dtype=torch.bfloat16)
    proposer = DraftModelProposer(lm, None, None, dv)
    assert proposer._native(pool, dv)
    a, b = pool.allocate(), pool.allocate()
    g = torch.Generator().manual_seed(2)
    lm.rotary.reserve(64, lm.device, lm.dtype)
    with torch.inference_mode():
        for _ in range(3):  # interleaved growth: slot a's blocks are not consecutive
            for s in (a, b):
                meta = pool.prepare([s], [3])
                lm(torch.randint(0, 96, (1, 3), generator=g), meta.positions, pool, meta)
        assert pool._tables[a] != list(range(pool._tables[a][0], pool._tables[a][0] + len(pool._tables[a])))
        x = torch.randint(0, 96, (catch_up,), generator=g)
        u = torch.rand(1, steps, dtype=torch.float64, generator=g)
        temp = torch.tensor([0.8 if sampled else 0.0])

        draw = reference_draw(dv, temp, u)
        meta = pool.prepare([a], [catch_up])
        t, q = draw(lm(x[None], meta.positions, pool, meta)[:, -1], 0)
        want, want_q = [t], [q]
        for i in range(1, steps):
            meta = pool.prepare([a], [1])
            t, q = draw(lm(t[:, None], meta.positions, pool, meta)[:, 0], i)
            want.append(t)
            want_q.append(q)
        want_kv = [t.clone() for t in (*pool.k, *pool.v)]
        written = pool._rows(a, range(9, 9 + catch_up + steps - 1))
        pool.truncate_to(a, 9)
        for t in (*pool.k, *pool.v):
            t[written] = 0  # what the round writes, wiped
        start = pool.extend(a, catch_up + steps - 1)
        got, got_q = proposer._round(x.tolist(), pool, a, start, dv, temp, u)
    assert start == 9 and pool.seq_len(a) == 9 + catch_up + steps - 1
    assert torch.equal(got, torch.stack(want, 1))
    torch.testing.assert_close(got_q, torch.stack(want_q, 1), rtol=1e-5, atol=1e-7)
    assert all(torch.equal(t, w) for t, w in zip((*pool.k, *pool.v), want_kv))
    assert len(set(got.flatten().tolist())) > 1 or steps == 1


def test_the_op_names_what_does_not_match():
    """Bad arguments are refused with what is wrong, not read out of bounds."""
    lm = _quantized_lm(64, seed=1)
    from infer.cache.paged import PagedKVCachePool

    c = lm.config
    dv = DraftVocab(lm.lm_head_weight, range(32)).quantized("q8_0")
    pool = PagedKVCachePool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 8, 4, dtype=torch.bfloat16)
    proposer = DraftModelProposer(lm, None, None, dv)
    assert proposer._native(pool, dv)
    slot = pool.allocate()
    start = pool.extend(slot, 2)
    u, temp = torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1)
    lm.rotary.reserve(16, lm.device, lm.dtype)
    with pytest.raises(RuntimeError, match="token id 64 outside the embedding"):
        proposer._round([64], pool, slot, start, dv, temp, u)
    with pytest.raises(RuntimeError, match="outside the rotary tables or the block table"):
        proposer._round([1, 2, 3, 4, 5], pool, slot, start, dv, temp, u)  # more entries than the pool took blocks for


def test_an_unquantized_or_float32_drafter_keeps_its_steps():
    """The op runs bfloat16 block-quantized drafters over a quantized vocabulary only; others keep the module's
    steps."""
    from infer.cache.paged import PagedKVCachePool
    from infer.cache.slotted import SlottedKVCache

    lm = random_llama(64, seed=1).to(torch.bfloat16)
    c = lm.config
    pool = PagedKVCachePool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 8, 4, dtype=torch.bfloat16)
    dv = DraftVocab(lm.lm_head_weight, range(32))
    assert not DraftModelProposer(lm, None, None, dv.quantized("q8_0"))._native(pool, dv.quantized("q8_0"))
    q = _quantized_lm(64, seed=1)
    qdv = DraftVocab(q.lm_head_weight, range(32)).quantized("q8_0")
    assert not DraftModelProposer(q, None, None, dv)._native(pool, dv)  # vocabulary rows unquantized
    assert not DraftModelProposer(q, None, None, qdv)._native(pool, None)  # no draft vocabulary
    f32_rows = DraftVocab(q.lm_head_weight.float(), range(32)).quantized("q8_0").including([40, 41])
    assert not DraftModelProposer(q, None, None, qdv)._native(pool, f32_rows)  # float32 rows added
    assert DraftModelProposer(q, None, None, qdv)._native(pool, qdv.including([40, 41]))
    slotted = SlottedKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, 2, dtype=torch.bfloat16)
    assert not DraftModelProposer(q, None, None, qdv)._native(slotted, qdv)


def test_greedy_parity_with_a_draft_lms_round_in_one_cpp_call(counted):
    """Greedy tokens of a bfloat16 target speculating with a quantized draft LM whose lone rows' rounds run as one
    C++ call equal plain decoding's, pinned and auto K, the LM alone and beside prompt lookup; a prompt longer than a
    catch-up batch (fed alone first) too."""
    target = random_llama(64, seed=0, hidden_size=64).to(torch.bfloat16)
    drafter = _quantized_lm(64, seed=1, hidden_size=64, noise_from=0, noise=0.3)
    dv = DraftVocab(drafter.lm_head_weight, range(0, 64, 2)).quantized("q8_0")
    params = SamplingParams(temperature=0, max_tokens=40)
    for prompt in ([1, 2, 3], [5, 1, 7, 2, 2, 0, 3, 4, 6, 1, 5, 2, 7, 3, 0, 1, 1, 2, 6, 4, 3, 9, 11, 40, 33]):
        want = autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids
        for k, proposer in ((3, "draft"), (1, "draft"), ("auto", "draft"), (3, "hybrid")):
            counted.clear()
            out, _ = speculative_generate(target, drafter, prompt, params, spec_length=k, proposer=proposer,
                                          eos_token_ids=[], kv_cache_backend="paged", draft_vocab=dv)
            assert out.output_ids == want, (k, proposer)
            assert counted or k == "auto", (k, proposer)  # the rounds ran as one call


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=3),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=3)],
                         ids=["T=1", "T=0.7+top-k+top-p"])
def test_joint_distribution_equals_target_through_a_draft_lms_cpp_round(counted, params):
    """The law of (x1, x2) with the draft LM's rounds drawn inside the one C++ call (one request at a time, K = 2,
    over a quantized draft vocabulary of half the tokens: q = 0 outside it; top-k / top-p rows draft from their plain
    temperature law), judged by the q the call reports."""
    target = random_llama(V, seed=0).to(torch.bfloat16)
    drafter = random_llama(V, seed=1, noise_from=0, noise=0.3).to(torch.bfloat16)
    dv = DraftVocab(drafter.lm_head_weight, [0, 2, 3, 6])
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=2, max_batch_size=1, block_size=4,
                              seed=1234, draft_quantization="q8_0"), model=target, draft_model=drafter, draft_vocab=dv)
    reqs = eng.run([eng.add_request([1], params) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[0], r.output_ids[1]] += 1
    assert len(counted) >= N // 2 and 0.1 < eng.stats.acceptance_rate < 0.9
    assert chi2_pvalue(counts, exact_joint(target, params, first=1, prompt=[1])) > 0.001
