"""Drafters that draft from the target's hidden states (EAGLE-style head, EAGLE-3 head, Medusa-style heads): the feature
store's bookkeeping, greedy parity on both KV backends with pinned and auto K (alone, in a hybrid, in a batch that
preempts), the exact joint law under sampling through the batched engine (and a lossy rule caught with the same
drafter), and a shipped head's directory round trip through ``LLM(draft_model=...)``."""

import random

import pytest
import torch

from infer import LLM
from infer.engine import Engine, EngineConfig
from infer.generate import autoregressive_generate
from infer.model.draft_heads import load_heads, save_heads
from infer.model.loader import load_model
from infer.request import Request
from infer.sampling import SamplingParams
from infer.speculative import speculative_generate
from infer.proposers.features import FeatureStore
from infer.spec_decode.cost_model import CostModel
from infer.spec_decode.spec_length import GoodputSpecLength
from infer.testing import random_heads, random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint

KINDS = ["eagle", "eagle3", "medusa"]


def test_feature_store_keeps_positions_in_order():
    store, r = FeatureStore(), Request([1, 2, 3], SamplingParams())
    h = torch.arange(12.0).view(6, 2)  # f_0 .. f_5, f_i = [2i, 2i + 1]
    store.add(r, 0, h[:3])
    store.add(r, 3, h[3:5])
    assert store.end(r) == 5 and torch.equal(store.get(r, 1, 5, 2, torch.float32, "cpu"), h[1:5])
    store.add(r, 2, h[2:3] + 100)  # a recomputed position replaces it and drops what followed
    assert store.end(r) == 3 and store.last(r)[0] == 2 and store.last(r)[1][0] == 104
    store.add(r, 5, h[5:])  # a gap (a prefix-cache hit) reads back as zeros
    got = store.get(r, 2, 6, 2, torch.float32, "cpu")
    assert torch.equal(got[1:3], torch.zeros(2, 2)) and torch.equal(got[3], h[5])
    store.drop_before(r, 4)
    assert torch.equal(store.get(r, 2, 6, 2, torch.float32, "cpu")[:2], torch.zeros(2, 2))  # forgotten: zeros
    assert store.end(r) == 6


def test_feature_store_matches_a_position_map_under_any_hand_overs():
    """The store keeps hand-overs as chunks, joined when read (a plain step's row is no longer copied with the whole
    run every step): against a plain map of position -> row, random hand-overs (in order, recomputed, after a gap),
    drops and reads agree, the store's end and last row too; a store that reads some columns of what it is handed
    (an EAGLE-3 head's: the captured layers after the final state) reads those of the same rows."""
    import random
    rng = random.Random(0)
    for i in range(100):
        cols = slice(None) if i % 2 else slice(2, None)
        store, r, ref, pos = FeatureStore(cols), Request([1, 2, 3], SamplingParams()), {}, rng.randint(0, 5)
        for _ in range(30):
            if rng.random() < 0.6:
                n = rng.randint(1, 3)
                start = max(0, pos + rng.choice([0, 0, 0, -2, 1, 3])) if ref else pos
                h = torch.randn(n, 4 if cols.start is None else 6)  # the reader's 4 columns either way
                store.add(r, start, h)
                if ref and start < min(ref):
                    ref.clear()
                end = max(ref) + 1 if ref else start
                ref = {p: v for p, v in ref.items() if p < start}
                ref.update({p: torch.zeros(4) for p in range(end, start)})
                ref.update({start + j: h[j, cols] for j in range(n)})
                pos = start + n
            elif ref:
                cut = rng.randint(min(ref), max(ref) + 1)
                store.drop_before(r, cut)
                ref = {p: v for p, v in ref.items() if p >= cut}
            if ref:
                lo, hi = min(ref), max(ref) + 1
                a, b = rng.randint(lo - 2, hi - 1), rng.randint(hi, hi + 2)
                want = torch.stack([ref.get(p, torch.zeros(4)) for p in range(a, b)])
                assert torch.equal(store.get(r, a, b, 4, torch.float32, "cpu"), want)
                assert store.end(r) == hi and store.last(r)[0] == hi - 1 and torch.equal(store.last(r)[1], ref[hi - 1])


@pytest.fixture(scope="module")
def target():
    return random_llama(V, seed=0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_heads_device_and_dtype_follow_its_weights_through_casts_and_quantization(target, kind):
    """A head's ``device`` and ``dtype`` read one parameter (DraftHead._anchor), not a walk of its modules: they must
    still say where its weights are after a cast, and after its projections are quantized away."""
    from infer.model.quant import quantize_linears

    head = random_heads(target, kind, seed=3)
    assert (head.device, head.dtype) == (next(head.parameters()).device, next(head.parameters()).dtype)
    head.to(torch.bfloat16)
    assert head.dtype == torch.bfloat16 == next(head.parameters()).dtype
    quantize_linears(head, "int8")
    assert head.dtype == torch.bfloat16 and head.device == next(head.parameters()).device


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_parity(target, kind, backend):
    head = random_heads(target, kind, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    accepted = 0
    for prompt in ([1, 2, 3], [5, 1, 7, 2, 2, 0, 3, 4, 6, 1, 5, 2, 7, 3, 0, 1, 1, 2, 6, 4, 3]):  # > 16: fed alone
        want = autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids
        for k, proposer in ((3, "draft"), ("auto", "draft"), (3, "hybrid"), (3, "suffix-hybrid")):
            out, stats = speculative_generate(target, head, prompt, params, spec_length=k, proposer=proposer,
                                              eos_token_ids=[], kv_cache_backend=backend)
            assert out.output_ids == want, (k, proposer)
            if k == 3 and proposer == "draft":
                accepted += sum(stats.accepted_per_position[1:])
    assert accepted > 0  # runs of 2+ accepted drafts happened: rollback after partial acceptance was exercised


@pytest.mark.parametrize("prefix", [False, True], ids=["", "prefix-cache"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_parity_with_preemption(kind, prefix):
    """With the prefix cache, prompts share leading tokens (some a whole number of blocks, where a head's hit ends a
    block short of the target's: kv_manager), and preempted rows are admitted again over cached blocks of both
    pools."""
    target = random_llama(64, seed=0)
    head = random_heads(target, kind, seed=3)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=3, max_batch_size=6,
                              num_kv_blocks=20 if prefix else 14, block_size=4, enable_prefix_caching=prefix),
                 model=target, draft_model=head)
    rnd = random.Random(1)
    common = [rnd.randrange(0, 64) for _ in range(9)]
    prompts = [[rnd.randrange(0, 64) for _ in range(rnd.randrange(3, 20))] for _ in range(8)]
    if prefix:
        prompts = [common[:8 + i % 2] + p for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = eng.run([eng.add_request(p, params, eos_token_ids=[]) for p in prompts])
    assert [r.output_ids for r in reqs] == [autoregressive_generate(target, p, params, eos_token_ids=[]).output_ids
                                            for p in prompts]
    assert eng.stats.num_preemptions > 0  # preempted rows were prefilled again: their features handed over anew
    assert (eng.stats.prefix_cache_hit_tokens > 0) == prefix
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


@pytest.mark.parametrize("first_drafts", [True, False], ids=["", "first undrafted"])
@pytest.mark.parametrize("common", [13, 12], ids=["inside a block", "at a block's end"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_prefix_hit_serves_the_heads_entries_as_computed(kind, common, first_drafts):
    """A prompt that starts as an earlier one did takes the head's cached entries over that prefix with the target's
    blocks (kv_manager): its drafts are the ones an engine without the prefix cache drafts for it, where a head fed
    zeros for the states the target's cache served drafts otherwise. Where the common prefix ends at a block's end,
    the head's last block reads a token past it and is not served: the target computes that block again. A first
    request that never drafted (``speculate=False``) has its head fed when it is freed (EagleProposer.release)."""
    target = random_llama(64, seed=0)
    head = random_heads(target, kind, seed=3)
    rnd = random.Random(2)
    first = [rnd.randrange(0, 64) for _ in range(17)]
    second = first[:common] + [rnd.randrange(0, 64) for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def drafts(cache: bool) -> tuple[list, Engine]:
        eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=3, block_size=4,
                                  enable_prefix_caching=cache), model=target, draft_model=head)
        eng.run([eng.add_request(first, params, eos_token_ids=[], speculate=first_drafts)])
        proposer, seen = eng.decoder.proposer, []
        orig = proposer.propose

        def propose(batch):
            out = orig(batch)
            seen.append(out.drafts[0, :out.num_draft[0]].tolist())
            return out
        proposer.propose = propose
        req = eng.run([eng.add_request(second, params, eos_token_ids=[])])[0]
        return seen, req, eng

    want, plain, _ = drafts(False)
    got, req, eng = drafts(True)
    assert req.num_cached_tokens == (12 if common == 13 else 8)  # a block short where the head's hit is
    assert req.output_ids == plain.output_ids and len(want) > 2
    assert got == want
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


PARAMS = [SamplingParams(temperature=1.0, max_tokens=4), SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                                          max_tokens=4)]
PROMPT = [1, 2]


def _pvalue(kind, params, prompt=PROMPT, **cfg):
    """N concurrent requests: token 1 comes from the prefill (whose state the heads draft from), tokens 2 and 3 from
    one round (K = 2) -> the chi-square p-value of (x2, x3). With ``prompt`` longer than a block and the prefix cache
    on, later requests take both pools' blocks over it (the head's entries with the target's K/V)."""
    target = random_llama(V, seed=0)
    head = random_heads(target, kind, seed=3)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=2, max_batch_size=32, block_size=4,
                              seed=1234, **cfg), model=target, draft_model=head)
    reqs = eng.run([eng.add_request(prompt, params) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert 0.1 < eng.stats.acceptance_rate < 0.9  # drafts are judged, and rejected often
    if cfg.get("enable_prefix_caching"):
        assert eng.stats.prefix_cache_hit_tokens > 0 and eng.kv.draft_pool.prefix_hits > 0
    return chi2_pvalue(counts, exact_joint(target, params, first=2, prompt=prompt))


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
@pytest.mark.parametrize("kind", KINDS)
def test_joint_distribution_equals_target(kind, params):
    assert _pvalue(kind, params) > 0.001


def test_joint_distribution_equals_target_over_prefix_hits():
    """Requests after the first wave of 32 take a cached block of their 6-token prompt in both pools."""
    assert _pvalue("eagle3", PARAMS[1], prompt=[1, 2, 3, 4, 5, 6], enable_prefix_caching=True) > 0.001


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.6, max_tokens=4), PARAMS[1]],
                         ids=["T=0.6", "T=0.7+top-k+top-p"])
def test_joint_distribution_equals_target_when_a_chain_draws_at_a_temperature(params, monkeypatch):
    """The EAGLE-3 head's draft steps draw inside its round's one call (draft_round: the first step and the chain
    after it; K = 2), q from softmax(logits / T): at a plain temperature, and for rows with top-k and top-p too,
    whose drafts come from that unfiltered law (proposers.base.temperature_law_drafts) and are judged by it, so the
    target's filters reject what lies outside them. The random head's flat logits leave this test little power
    against a q that drops the temperature (p ~0.1-0.2 for it): test_a_draft_chain_gives_the_single_steps_drafts
    pins q exactly; it does catch drafts judged as deterministic (q one-hot) where they were drawn."""
    from infer.model.draft_heads import DraftHead

    calls = []
    orig = DraftHead.draft_round
    monkeypatch.setattr(DraftHead, "draft_round", lambda *a: calls.append(1) or orig(*a))
    assert _pvalue("eagle3", params) > 0.001
    assert calls  # the rounds ran as one call


def test_filtered_rows_drafts_follow_the_law_they_are_judged_by(monkeypatch):
    """Rows with top-k and top-p draft inside the compiled round from their plain temperature law: each draft must be
    a draw from the q the proposal reports (which verification judges it by), not from the filtered law the
    target samples. The drafts of the rounds that ran as one call (draft_round), against the sum of their q (a
    goodness-of-fit test; each draft is one draw from its own q, given the state and the drafts before it). Catches
    a q reported filtered for drafts drawn unfiltered (drafts where q is 0: p ~1e-17) or sharpened by 1 / 0.7
    (~1e-12)."""
    from infer.model.draft_heads import DraftHead

    target = random_llama(V, seed=0)
    head = random_heads(target, "eagle3", seed=3)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=2, max_batch_size=32, block_size=4,
                              seed=1234), model=target, draft_model=head)
    proposer = eng.decoder.proposer
    counts, expected, calls, orig = torch.zeros(V), torch.zeros(V), [], proposer.propose
    orig_round = DraftHead.draft_round
    monkeypatch.setattr(DraftHead, "draft_round", lambda *a: calls.append(1) or orig_round(*a))

    def propose(batch):
        calls.clear()
        out = orig(batch)
        for b, n in enumerate(out.num_draft):
            for j in range(n if calls else 0):  # draft j is one draw from q[b, j], given the drafts before it
                counts[out.drafts[b, j]] += 1
                expected.add_(out.q[b, j])
        return out

    proposer.propose = propose
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=12)
    eng.run([eng.add_request(PROMPT, params) for _ in range(N)])
    assert counts.sum() > N // 2 and int((expected > 0).sum()) > 5  # q is not filtered to top-k 5
    assert chi2_pvalue(counts, expected / expected.sum()) > 0.001


@pytest.mark.parametrize("kind", KINDS)
def test_joint_distribution_equals_target_on_the_contiguous_backend(kind):
    assert _pvalue(kind, PARAMS[0], kv_cache_backend="contiguous") > 0.001


@pytest.mark.parametrize("kind", KINDS)
def test_lossy_rule_is_detected_with_the_same_drafter(kind):
    assert _pvalue(kind, PARAMS[0], acceptance="skip_adjustment") < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_round_in_one_call_gives_the_same_tokens_as_its_parts(gqa_dir, tmp_path, temperature):
    """EagleHead.draft_round (a round's first step and chain in one call) against the same engine with it off: the
    same drafts from the same uniforms (each row's next m + 1 from its generator, as one draw and a chain of m take),
    so the same tokens for the same seed, greedy and sampled, and the same acceptance counts."""
    target = load_model(gqa_dir)
    save_heads(random_heads(target, "eagle3", seed=5), tmp_path / "head", dtype=torch.float32)
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=7)
    prompts = [[3, 17, 42, 99], [250, 8], [5, 6, 7, 8, 9, 10]]
    got = {}
    for fused in (True, False):
        llm = LLM(gqa_dir, draft_model=tmp_path / "head", spec_length=3, max_batch_size=2)
        llm.engine.decoder.proposer.fused = fused
        calls = []
        head = llm.engine.decoder.proposer.head
        orig = head.draft_round
        head.draft_round = lambda *a, orig=orig: calls.append(1) or orig(*a)
        got[fused] = ([o.token_ids for o in llm.generate(prompts, params)], llm.engine.stats.num_accepted_tokens,
                      bool(calls))
    assert got[True][0] == got[False][0] and got[True][1] == got[False][1]
    assert got[True][2] and not got[False][2]  # the one call ran, and only where it was on
    if temperature == 0:
        assert got[True][0] == [o.token_ids for o in LLM(gqa_dir).generate(prompts, params)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_head_loads_by_kind_and_stays_lossless(gqa_dir, tmp_path, kind):
    target = load_model(gqa_dir)
    head = random_heads(target, kind, seed=5)
    save_heads(head, tmp_path / kind, dtype=torch.float32)
    loaded = load_heads(tmp_path / kind, target)
    f = torch.randn(3, head.feature_width if kind == "eagle3" else target.config.hidden_size)
    if kind == "medusa":
        assert torch.equal(loaded(f, 2), head(f, 2))
    else:
        pos = torch.arange(3)[None]
        x = torch.tensor([[4, 5, 6]])
        assert torch.equal(loaded(x, f[None], pos), head(x, f[None], pos))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 17, 42, 99], [250, 8]]
    want = [o.token_ids for o in LLM(gqa_dir).generate(prompts, params)]
    spec = LLM(gqa_dir, draft_model=tmp_path / kind, spec_length=3)
    assert type(spec.engine.decoder.proposer).__name__.lower().startswith(kind.rstrip("3"))
    assert getattr(spec.engine.decoder.proposer, "head", head).kind == kind
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    other = random_llama(V, seed=0)  # hidden size 32, not the checkpoint's: refused by name
    with pytest.raises(ValueError, match="hidden size"):
        load_heads(tmp_path / kind, other)


@pytest.mark.parametrize("backend", ["slotted", "paged"])
def test_eagle3_training_unroll_equals_cached_drafting(backend):
    """Eagle3Head.unroll (the training-time test the head is trained with) computes what drafting computes: step 0
    as the causal forward over true entries, step s as the s-th draft step over a KV pool holding the true entries
    and the drafts before it, when each draft is the true next token."""
    from infer.cache.paged import PagedKVCachePool
    from infer.cache.slotted import SlottedKVCache

    target = random_llama(64, seed=0)
    head = random_heads(target, "eagle3", seed=3)
    L, S, H = 9, 3, target.config.hidden_size
    tokens = torch.randint(0, 64, (2, L + S + 1), generator=torch.Generator().manual_seed(0))
    # entries in both rows, in no particular order (the training batches' selection is row-major; nothing relies on it)
    select = torch.tensor([[1, L - 2], [0, 2], [1, 0], [0, L - 2]])
    with torch.no_grad():
        aux = target(tokens)[..., H:]  # the captured layers follow the final state
        out0, outs, _ = head.unroll(tokens, aux, S, select=select)
        assert torch.allclose(out0, head(tokens[:, 1:], aux[:, :-1], torch.arange(tokens.shape[1] - 1)[None]),
                              atol=1e-5)
        c = head.config
        for m, (row, i) in enumerate(select.tolist()):  # entry i's drafts: the cache holds true entries 0 .. i
            pool = SlottedKVCache(1, c.num_key_value_heads, c.head_dim, 64) if backend == "slotted" else \
                PagedKVCachePool(1, c.num_key_value_heads, c.head_dim, 16, 4)
            slot = pool.allocate(L + S)
            meta = pool.prepare([slot], [i + 1])
            prev = head(tokens[row:row + 1, 1:i + 2], aux[row:row + 1, :i + 1], meta.positions, pool, meta)[:, -1:]
            assert torch.allclose(prev[0, 0], out0[row, i], atol=1e-5)
            for s in range(1, S):  # draft s: the true token x_{i+1+s}, the step before's output, position i+s
                meta = pool.prepare([slot], [1])
                prev = head(tokens[row:row + 1, i + 1 + s: i + 2 + s], prev, meta.positions, pool, meta)
                assert torch.allclose(prev[0, 0], outs[s - 1][m], atol=1e-5), (m, s)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("backend", ["slotted", "paged"])
@pytest.mark.parametrize("vocab", ["eagle over a subset", "eagle over q8_0 rows and a prompt's", "eagle3's own"])
def test_a_draft_chain_gives_the_single_steps_drafts(backend, vocab, sampled, fused):
    """EagleHead.draft_chain (issue 33: a round's later draft steps in one graph) computes what the single steps
    and their draws compute: each step's argmax over the draft vocabulary, or its draw from softmax(logits / T)
    with the row's next uniform (q returned), fed to the next step, two rows at once, the cache written where single
    steps write it. ``fused``: draft_round, the round's first step in the same call, from catch-up entries of
    unequal lengths (3 and 1: one row padded) whose last outputs are drawn from first."""
    from infer.cache.paged import PagedKVCachePool
    from infer.cache.slotted import SlottedKVCache
    from infer.proposers.draft_vocab import DraftVocab, HeadVocab
    from infer.sampling import inverse_cdf

    target = random_llama(64, seed=0)
    kind = "eagle3" if vocab == "eagle3's own" else "eagle"
    head = random_heads(target, kind, seed=3)
    if kind == "eagle3":
        dv = HeadVocab(head)
    else:
        dv = DraftVocab(target.lm_head_weight, range(0, 64, 2))
        if "q8_0" in vocab:
            dv = dv.quantized("q8_0").including([5, 9, 11])
            assert dv.extra_weight is not None
    c, H = head.config, target.config.hidden_size
    W = head.feature_width if kind == "eagle3" else H
    pool = SlottedKVCache(1, c.num_key_value_heads, c.head_dim, 64, max_slots=2) if backend == "slotted" else \
        PagedKVCachePool(1, c.num_key_value_heads, c.head_dim, 32, 4)
    slots = [pool.allocate(24), pool.allocate(24)]
    g = torch.Generator().manual_seed(1)
    temp = torch.tensor([0.7, 1.3]) if sampled else None
    with torch.inference_mode():
        meta = pool.prepare(slots, [7, 7])
        feats = torch.randn(2, 7, W, generator=g)
        head(torch.randint(0, 64, (2, 7), generator=g), feats, meta.positions, pool, meta)
        tok, hidden = torch.tensor([3, 8]), torch.randn(2, H, generator=g)
        u = torch.rand(2, 4, dtype=torch.float64, generator=g)
        # the fused round's catch-up: row 0 brings 3 entries, row 1 one (padded to 3)
        x, f = torch.randint(0, 64, (2, 3), generator=g), torch.randn(2, 3, W, generator=g)
        lens = [3, 1]

        def draw(h, i):
            logits = dv.logits(h)
            if sampled:
                q = (logits / temp[:, None]).softmax(-1)
                return dv.token(inverse_cdf(q, u[:, i])), q
            return dv.token(logits.max(-1).indices), None

        def singles(m):
            t, h, out, qs = tok, hidden, [], []
            if fused:  # the catch-up forward, each row's last output drawn from
                meta = pool.prepare(slots, lens)
                h = head(x, f, meta.positions, pool, meta)[torch.arange(2), torch.tensor(lens) - 1]
                t, q = draw(h, 0)
                out.append(t)
                qs.append(q)
            for i in range(fused, m + fused):
                meta = pool.prepare(slots, [1, 1])
                h = head(t[:, None], h[:, None], meta.positions, pool, meta)[:, 0]
                t, q = draw(h, i)
                out.append(t)
                qs.append(q)
            return torch.stack(out, 1), h, torch.stack(qs, 1) if sampled else None

        want, want_h, want_q = singles(3)
        # the slotted pool's keys but its scratch column (the pads' writes: two to one column, either may land last)
        want_k = pool.k[0][:, :, :-1].clone() if backend == "slotted" else None
        for s in slots:
            pool.truncate_to(s, 7)
        t = temp if sampled else torch.zeros(2)
        if fused:
            metas = [pool.prepare(slots, lens)] + pool.prepare_run(slots, 3)
            got, got_h, got_q = head.draft_round(x, f, torch.tensor(lens) - 1, pool, metas, dv, t, u)
        else:
            got, got_h, got_q = head.draft_chain(tok, hidden, pool, [pool.prepare(slots, [1, 1]) for _ in range(3)],
                                                 dv, t, u)
    assert torch.equal(got, want) and torch.equal(got_h, want_h)
    assert not sampled or torch.equal(got_q, want_q)
    assert len(set(got.flatten().tolist())) > 1
    assert [pool.seq_len(s) for s in slots] == ([13, 11] if fused else [10, 10])
    if want_k is not None:
        assert torch.equal(pool.k[0][:, :, :-1], want_k)


def test_eagle3_training_steps_reach_every_weight():
    """A training step's later draft steps feed one entry a row ([M, 1, H]): few tokens a row, but autograd records
    and the norms' and products' weights want gradients, so they must take ATen's ops (infer's kernels have no
    backward). Gated on the input alone, the embedding's norm (its input, the frozen embedding, needs no gradient)
    took infer::rms_norm there and its weight got no gradient from steps >= 1."""
    target = random_llama(64, seed=0)
    head = random_heads(target, "eagle3", seed=3).train().requires_grad_(True)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        aux = target(tokens)[..., target.config.hidden_size:]
    _, outs, _ = head.unroll(tokens, aux, 3, embed=target.embed_tokens)
    sum(o.square().sum() for o in outs).backward()  # the later steps only
    for name, p in head.named_parameters():
        if name.startswith("layer."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def screened_logits(head, h: torch.Tensor, top: int) -> torch.Tensor:
    """What the one-call round's screen scores (kernels/eagle_round.cpp): the vocabulary head's rows in Q4_0, the
    ``top`` largest of those rescored by the head's own rows (the full product's values there)."""
    normed = head.norm(h)
    screen = torch.ops.infer.qlinear(normed, head._screen(head.lm_head), 2, head.lm_head.out_features, None, True)
    own = head.lm_head(normed).float()
    best = screen.topk(top, -1).indices
    return screen.scatter(-1, best, own.gather(-1, best))


def reference_draw(dv, temp: torch.Tensor, u: torch.Tensor, logits_of=None):
    """The draw a one-call round is held to, over hidden states [1, H] -> (draft [1], q [1, N]) for draft i: the
    argmax of the draft vocabulary's logits (temp 0), else inverse_cdf(q, u[:, i]), q = softmax(logits / temp).
    ``logits_of``: the logits in place of the draft vocabulary's (a screen's)."""
    from infer.sampling import inverse_cdf

    sampled = bool(temp.item() > 0)

    def draw(h, i):
        logits = (logits_of or dv.logits)(h)
        q = (logits / (temp[:, None] if sampled else 1.0)).softmax(-1)
        return dv.token(inverse_cdf(q, u[:, i]) if sampled else logits.max(-1).indices), q

    return draw


@pytest.mark.parametrize("screen", [0, 8])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("catch_up,steps", [(1, 1), (3, 4), (5, 2), (20, 1)])  # 20: a long catch-up (a prompt)
def test_a_lone_rows_round_in_one_cpp_call_gives_the_single_steps_drafts(catch_up, steps, sampled, screen):
    """Eagle3Head.native_round (kernels/eagle_round.cpp: a lone row's round in one C++ call) against the module's
    single steps on a quantized bfloat16 head: the same drafts, the same last output, bit for bit, the same laws q (to
    the exp's last bits), and the same keys and values written to the same storage rows of a paged pool whose blocks
    are not consecutive. With a screen (``screen_top`` 8): the drafts and laws of the screen's logits, the Q4_0 rows'
    with their best 8 the head's own."""
    from infer.cache.paged import PagedKVCachePool
    from infer.model.quant import quantize_linears
    from infer.proposers.draft_vocab import HeadVocab

    target = random_llama(96, seed=0, hidden_size=64).to(torch.bfloat16)
    head = quantize_linears(random_heads(target, "eagle3", seed=3), "q8_0")
    head.screen_top = screen
    assert head.native_round_ready() and (head._native[0][5] is not None) == bool(screen)
    dv, c = HeadVocab(head), head.config
    pool = PagedKVCachePool(1, c.num_key_value_heads, c.head_dim, 32, 4, dtype=torch.bfloat16)
    a, b = pool.allocate(), pool.allocate()
    g = torch.Generator().manual_seed(2)
    W = head.feature_width
    with torch.inference_mode():
        for _ in range(3):  # interleaved growth: slot a's blocks are not consecutive
            for s in (a, b):
                meta = pool.prepare([s], [3])
                head(torch.randint(0, 96, (1, 3), generator=g), torch.randn(1, 3, W, generator=g).bfloat16(),
                     meta.positions, pool, meta)
        assert pool._tables[a] != list(range(pool._tables[a][0], pool._tables[a][0] + len(pool._tables[a])))
        x = torch.randint(0, 96, (catch_up,), generator=g)
        f = torch.randn(catch_up, W, generator=g).bfloat16()
        u = torch.rand(1, steps, dtype=torch.float64, generator=g)
        temp = torch.tensor([0.8 if sampled else 0.0])

        draw = reference_draw(dv, temp, u, (lambda h: screened_logits(head, h, screen)) if screen else None)
        meta = pool.prepare([a], [catch_up])
        h = head(x[None], f[None], meta.positions, pool, meta)[:, -1]
        t, q = draw(h, 0)
        want, want_q = [t], [q]
        for i in range(1, steps):
            meta = pool.prepare([a], [1])
            h = head(t[:, None], h[:, None], meta.positions, pool, meta)[:, 0]
            t, q = draw(h, i)
            want.append(t)
            want_q.append(q)
        want_kv = [t.clone() for t in (pool.k[0], pool.v[0])]
        written = pool._rows(a, range(9, 9 + catch_up + steps - 1))
        pool.truncate_to(a, 9)
        for t in (pool.k[0], pool.v[0]):
            t[written] = 0  # what the round writes, wiped
        start = pool.extend(a, catch_up + steps - 1)
        got, got_h, got_q, got_conf = head.native_round(x, f, pool, a, start, temp, u)
    assert start == 9 and pool.seq_len(a) == 9 + catch_up + steps - 1
    assert torch.equal(got, torch.stack(want, 1)) and torch.equal(got_h, h)
    torch.testing.assert_close(got_q, torch.stack(want_q, 1), rtol=1e-5, atol=1e-7)
    cols = torch.searchsorted(dv.ids, got[0])  # each draft's column of the draft vocabulary
    assert torch.equal(got_conf[0], got_q[0, torch.arange(steps), cols])  # each draft's probability under its q
    if not sampled:
        assert torch.equal(got_conf, got_q.amax(-1))  # a greedy draft's: its law's largest
    assert torch.equal(pool.k[0], want_kv[0]) and torch.equal(pool.v[0], want_kv[1])


def test_a_one_call_rounds_sampled_draw_is_the_inverse_cdf_of_the_law_it_returns():
    """The one-call round's draw (kernels/round.h) over a grid of uniforms u: each draft is the column where the
    cumulation of the q the call returns passes u x its total, a column of q > 0. So every u in [0, 1) maps to a draft
    drawn from exactly q: the blocked float64 cumulation on AVX-512 and the scalar one alike (losslessness rests on it:
    the verify divides by this q)."""
    from infer.cache.paged import PagedKVCachePool
    from infer.model.quant import quantize_linears
    from infer.proposers.draft_vocab import HeadVocab

    target = random_llama(96, seed=0, hidden_size=64).to(torch.bfloat16)
    head = quantize_linears(random_heads(target, "eagle3", seed=3), "q8_0")
    assert head.native_round_ready()
    dv, c = HeadVocab(head), head.config
    pool = PagedKVCachePool(1, c.num_key_value_heads, c.head_dim, 32, 4, dtype=torch.bfloat16)
    a = pool.allocate()
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 96, (1,), generator=g)
    f = torch.randn(1, head.feature_width, generator=g).bfloat16() * 4  # a law with some weight on many columns
    col = {int(t): j for j, t in enumerate(dv.ids)}
    n = 400
    hits = torch.zeros(len(dv.ids))
    with torch.inference_mode():
        for k in range(n):
            u = torch.tensor([[(k + 0.5) / n]], dtype=torch.float64)
            start = pool.extend(a, 1)
            got, _, q, _ = head.native_round(x, f, pool, a, start, torch.tensor([1.0]), u)
            pool.truncate_to(a, 0)
            q = q[0, 0].double()
            cdf = q.cumsum(0) / q.sum()
            j = col[int(got[0, 0])]
            assert q[j] > 0
            assert (cdf[j - 1] if j else 0.0) - 1e-9 <= u.item() <= cdf[j] + 1e-9
            hits[j] += 1
    assert hits.sum() == n and (hits > 0).sum() > 3  # the grid spreads over several columns


def _native_head(target, screen: int | None = None):
    """An EAGLE-3 head the one-call round runs (Eagle3Head.native_round): bfloat16, its projections in Q8_0 blocks
    (what an engine's draft_quantization makes of it over a quantized target); ``screen``: its ``screen_top``, the
    screen checked to be on (> 0) or off (0)."""
    from infer.model.quant import quantize_linears

    head = quantize_linears(random_heads(target, "eagle3", seed=3), "q8_0")
    head.quantized = "q8_0"
    if screen is not None:
        head.screen_top = screen
    assert head.native_round_ready()
    assert screen is None or (head._native[0][5] is not None) == (screen > 0)
    return head


@pytest.mark.parametrize("screen", [0, 4])
def test_greedy_parity_with_a_lone_rows_round_in_one_cpp_call(monkeypatch, screen):
    """Greedy tokens of a bfloat16 target speculating with a head whose rounds run as one C++ call equal plain
    decoding's, pinned and auto K, the head alone and beside the suffix tree; prompts longer than a catch-up batch
    (fed alone first) too; with the head's own vocabulary rows and with a screen of them."""
    from infer.model.draft_heads import Eagle3Head

    calls = []
    orig = Eagle3Head.native_round
    monkeypatch.setattr(Eagle3Head, "native_round", lambda *a: calls.append(1) or orig(*a))
    target = random_llama(64, seed=0, hidden_size=64).to(torch.bfloat16)
    head = _native_head(target, screen)
    params = SamplingParams(temperature=0, max_tokens=40)
    for prompt in ([1, 2, 3], [5, 1, 7, 2, 2, 0, 3, 4, 6, 1, 5, 2, 7, 3, 0, 1, 1, 2, 6, 4, 3, 9, 11, 40, 33]):
        want = autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids
        for k, proposer in ((3, "draft"), (1, "draft"), ("auto", "draft"), (3, "suffix-hybrid")):
            calls.clear()
            out, _ = speculative_generate(target, head, prompt, params, spec_length=k, proposer=proposer,
                                          eos_token_ids=[], kv_cache_backend="paged")
            assert out.output_ids == want, (k, proposer)
            assert calls or k == "auto", (k, proposer)  # the rounds ran as one call


@pytest.mark.parametrize("screen", [0, 1])
def test_joint_distribution_equals_target_through_a_lone_rows_cpp_round(monkeypatch, screen):
    """The law of (x2, x3) with the head's rounds drawn inside the one C++ call (one request at a time, K = 2, at
    temperature 0.7 with top-k and top-p: drafts from the plain temperature law, judged by the q the call reports),
    with the head's own vocabulary rows and with a screen (the best row rescored by the head's own: a law other than
    the head's, which the verify must read as the law the drafts came from). The screen here is random rows, far
    from the head's: a round that drew from the screen's law and reported the head's own is caught."""
    from infer.model.draft_heads import Eagle3Head
    from infer.model.quant import pack_blocks, quantize_blocks

    calls = []
    orig = Eagle3Head.native_round
    monkeypatch.setattr(Eagle3Head, "native_round", lambda *a: calls.append(1) or orig(*a))
    target = random_llama(V, seed=0).to(torch.bfloat16)
    head = _native_head(target, screen)
    if screen:
        (packed, formats, outs, norms, eps, _), = head._native
        rows = torch.randn(head.lm_head.out_features, head.config.hidden_size,
                           generator=torch.Generator().manual_seed(9))
        head._native = ((packed, formats, outs, norms, eps, pack_blocks(quantize_blocks(rows, "q4_0"), "q4_0")),)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=2, max_batch_size=1, block_size=4,
                              seed=1234), model=target, draft_model=head)
    reqs = eng.run([eng.add_request(PROMPT, PARAMS[1]) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert len(calls) >= N // 2 and 0.1 < eng.stats.acceptance_rate < 0.9
    assert chi2_pvalue(counts, exact_joint(target, PARAMS[1], first=2, prompt=PROMPT)) > 0.001


@pytest.mark.parametrize("sampled", [False, True])
def test_a_one_call_round_stopped_by_confidence_is_the_whole_rounds_prefix(sampled):
    """Eagle3Head.native_round with a stop (kernels/eagle_round.cpp; auto K's GoodputSpecLength.stop): the round ends
    before draft j + 1 exactly where the product of the calibrated confidences of drafts 1 .. j falls under
    below[j - 1], and what it returns is the first drafts, laws and confidences of the same round without a stop, bit
    for bit."""
    from infer.cache.paged import PagedKVCachePool

    target = random_llama(96, seed=0, hidden_size=64).to(torch.bfloat16)
    head = _native_head(target)
    c, steps = head.config, 6
    pool = PagedKVCachePool(1, c.num_key_value_heads, c.head_dim, 32, 4, dtype=torch.bfloat16)
    a = pool.allocate()
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 96, (3,), generator=g)
    f = torch.randn(3, head.feature_width, generator=g).bfloat16() * 2
    u = torch.rand(1, steps, dtype=torch.float64, generator=g)
    temp = torch.tensor([0.8 if sampled else 0.0])
    cal = torch.linspace(0.05, 0.95, 10)

    def run(stop=None):
        with torch.inference_mode():
            start = pool.extend(a, 3 + steps - 1)
            out = head.native_round(x, f, pool, a, start, temp, u, stop)
            pool.truncate_to(a, 0)
        return out

    whole, _, whole_q, whole_conf = run()
    conf = whole_conf[0].tolist()
    chances, chance = [], 1.0  # after each draft, that the drafts so far are all accepted
    for p in conf[:-1]:
        chance *= cal.tolist()[min(9, int((torch.tensor(p) * 10).item()))]
        chances.append(chance)
    # no stop, a stop at every step, a bound just above the chance after draft j (and none elsewhere): a stop at j
    bounds = [[0.0] * 5, [1.0] * 5] + [[0.0] * j + [chances[j] * 1.01] + [0.0] * (4 - j) for j in range(5)]
    lengths = set()
    for below in bounds:
        got, _, q, got_conf = run((cal, torch.tensor(below)))
        want, chance = steps, 1.0
        for j in range(steps - 1):  # the rule, in the kernel's arithmetic: a float32 bin, a float64 product
            chance *= cal.tolist()[min(9, int((torch.tensor(conf[j]) * 10).item()))]
            if chance < torch.tensor(below[j]).item():
                want = j + 1
                break
        n = got.shape[1]
        lengths.add(n)
        assert n == want, below
        assert torch.equal(got, whole[:, :n]) and torch.equal(q, whole_q[:, :n]) and \
            torch.equal(got_conf, whole_conf[:, :n])
    assert lengths == set(range(1, steps + 1))


def _stopping(monkeypatch, below: float, drawn: list):
    """Auto K asking one draft a round, and a stop up to the row's cap at a fixed bound (``below`` for every step; 100
    confidence bins, acceptance 10 x the confidence up to 1: a random head's drafts, of a few percent confidence
    greedy, stop after one to several): the rounds' lengths are the head's confidence's. ``drawn``: the drafts each
    round drew."""
    from infer.model.draft_heads import Eagle3Head
    from infer.proposers.base import DraftStop

    monkeypatch.setattr(GoodputSpecLength, "choose", lambda self, reqs, caps: [min(1, c) for c in caps])
    cal = (torch.arange(100.0) / 10).clamp(max=1.0)
    monkeypatch.setattr(GoodputSpecLength, "stop", lambda self, reqs, caps, ks: DraftStop(
        caps[0], cal, torch.full((max(1, caps[0] - 1),), below)))
    orig = Eagle3Head.native_round

    def spy(*a):
        out = orig(*a)
        if len(a) > 7 and a[7] is not None:
            drawn.append(out[0].shape[1])
        return out

    monkeypatch.setattr(Eagle3Head, "native_round", spy)


def _auto_k_engine(target, head, **cfg) -> Engine:
    costs = CostModel.from_points(1, 4, {(1, 1): 1.0, (1, 5): 1.2}, {1: 0.05})
    costs.ema = 0.0
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length="auto", spec_length_max=4,
                              max_batch_size=1, block_size=4, seed=1234, **cfg), model=target, draft_model=head)
    eng.decoder.spec_length = GoodputSpecLength(4, costs)
    return eng


def test_greedy_parity_with_one_call_rounds_stopped_by_confidence(monkeypatch):
    """Greedy tokens of a bfloat16 target whose head's rounds run to lengths its confidence sets (1 .. 4 drafts)
    equal plain decoding's."""
    drawn = []
    _stopping(monkeypatch, 0.32, drawn)
    target = random_llama(64, seed=0, hidden_size=64).to(torch.bfloat16)
    head = _native_head(target, 0)
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = [[1, 2, 3], [5, 1, 7, 2, 2, 0, 3, 4, 6, 1, 5, 2]]
    want = [autoregressive_generate(target, p, params, eos_token_ids=[]).output_ids for p in prompts]
    eng = _auto_k_engine(target, head)
    got = [r.output_ids for r in eng.run([eng.add_request(p, params) for p in prompts])]
    assert got == want
    assert len(set(drawn)) >= 3 and max(drawn) > 1  # rounds stopped at several lengths, some beyond the K asked


def test_joint_distribution_equals_target_through_rounds_stopped_by_confidence(monkeypatch):
    """The law of (x2, x3) at temperature 0.7 with top-k and top-p, one request at a time, each round drawing 1 .. 4
    drafts inside the one C++ call as the head's confidence in the drafts before each step carries it: whether a step
    runs depends on the drafts already drawn, every one of which is judged, so the law is the target's."""
    drawn = []
    _stopping(monkeypatch, 0.32, drawn)
    target = random_llama(V, seed=0).to(torch.bfloat16)
    head = _native_head(target)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=6)
    eng = _auto_k_engine(target, head)
    reqs = eng.run([eng.add_request(PROMPT, params) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert len(drawn) >= N and len(set(drawn)) >= 3  # rounds of several lengths
    assert 0.1 < eng.stats.acceptance_rate < 0.9
    assert chi2_pvalue(counts, exact_joint(target, params, first=2, prompt=PROMPT)) > 0.001
