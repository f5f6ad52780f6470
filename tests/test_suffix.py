"""Suffix decoding (proposers/suffix.py, suffix_tree.cpp): the tree's counts and eviction, drafts from earlier
requests, and losslessness: greedy parity (both KV backends, batched, with preemption), the exact joint law under
sampling (chi-square, both backends) with a lossy rule caught, and a request's output independent of what other
requests put in the tree. The same for "suffix-hybrid" (the tree's copies where it has some, a draft model's drafts
for the other rows of the same round)."""

import random

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.generate import autoregressive_generate
from infer.proposers.base import DraftBatch
from infer.proposers.suffix import MATCH_GROUPS, SuffixProposer, suffix_tree_module
from infer.request import Request
from infer.sampling import SamplingParams
from infer.testing import random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint


def test_tree_counts_match_and_evict():
    t = suffix_tree_module().SuffixTree(4)
    t.extend(1, [1, 2, 3, 1, 2, 3])
    t.extend(2, [1, 2, 4])
    assert t.check() and t.num_tokens() == 9 and t.num_sequences() == 2
    drafts, match, prob, probs = t.speculate([9, 1, 2], 3, 0.0, min_match=2)
    # "1 2" is continued by 3 twice and by 4 once; "1 2 3" by 1 once and ends once; "1 2 3 1" is at the depth bound
    assert (drafts, match) == ([3, 1], 2) and prob == pytest.approx(2 / 3 * 1 / 2)
    assert probs == pytest.approx([2 / 3, 1 / 3])  # each prefix's probability
    # "2" alone drafts one token further before the depth bound (3, 1, then 2 after "2 3 1"): 2/3 + 1/3 + 1/3
    # expected accepted tokens against 2/3 + 1/3, so the shorter match's draft wins
    assert t.speculate([9, 1, 2], 3, 0.0)[:3] == ([3, 1, 2], 1, pytest.approx(1 / 3))
    assert t.speculate([7, 7], 3, 0.0) == ([], 0, 0.0, [])  # nothing matches
    t.extend(1, [1, 2, 4, 4])  # sequences grow in pieces
    assert t.check()
    t.remove(1)
    assert t.check() and t.num_tokens() == 3 and t.num_sequences() == 1
    assert t.speculate([1, 2], 3, 0.0)[0] == [4]
    t.remove(2)
    assert t.check() and t.num_nodes() == 0


def test_best_children_and_stored_lookups_survive_growth_and_eviction():
    """Each node's kept most frequent child stays right as sequences grow and are removed (check() re-derives it),
    and a stored sequence's lookup from its open suffixes equals walking its context from the root."""
    rnd = random.Random(0)
    t = suffix_tree_module().SuffixTree(6)
    seqs = {}
    for step in range(300):
        s = rnd.randrange(12)
        if s in seqs and rnd.random() < 0.15:
            t.remove(s)
            del seqs[s]
        else:
            toks = [rnd.randrange(5) for _ in range(rnd.randint(1, 6))]  # 5 symbols: many repeats and ties
            t.extend(s, toks)
            seqs.setdefault(s, []).extend(toks)
        if step % 10 == 0:
            assert t.check()
        for q, toks in seqs.items():
            for lf in (0.0, 1.0):
                want = t.speculate(toks[-5:], 4, 0.2, min_match=1, stored=True, length_factor=lf)
                got = t.speculate_stored(q, 4, 0.2, min_match=1, length_factor=lf)
                assert got[:2] == want[:2] and got[2] == pytest.approx(want[2])
    assert t.speculate_stored(99, 4, 0.2) == ([], 0, 0.0, [])  # no such sequence: no draft


def test_the_edge_table_grows_and_shrinks_with_the_tree():
    """Thousands of nodes (the edge table rehashes several times), then most sequences removed (erasure shifts
    entries back along their probe runs): every count and edge is still found (check()), and lookups agree with a
    tree built from the survivors alone."""
    rnd = random.Random(1)
    t = suffix_tree_module().SuffixTree(8)
    seqs = {s: [rnd.randrange(300) for _ in range(60)] for s in range(150)}
    for s, toks in seqs.items():
        t.extend(s, toks)
    assert t.check() and t.num_nodes() > 20_000
    for s in range(0, 150, 3):
        t.extend(s, [1, 2, 3])
        seqs[s] += [1, 2, 3]
    for s in list(seqs):
        if s % 5:
            t.remove(s)
            del seqs[s]
    fresh = suffix_tree_module().SuffixTree(8)
    for s, toks in seqs.items():
        fresh.extend(s, toks)
    assert t.check() and t.num_nodes() == fresh.num_nodes()
    for toks in seqs.values():  # one draft: the match and its best child's share do not depend on ties' order
        for m in (1, 2, 5):
            assert t.speculate(toks[-m:], 1, 0.0)[1:3] == fresh.speculate(toks[-m:], 1, 0.0)[1:3]


def test_min_prob_sets_the_draft_length():
    t = suffix_tree_module().SuffixTree(8)
    for s, tail in enumerate([[5, 6, 7], [5, 6, 8], [5, 9, 9]]):
        t.extend(s, [1, 2, 3] + tail)
    assert t.speculate([1, 2, 3], 3, 0.9)[0] == [5]  # 3 of 3 continue with 5, then 2 of 3 with 6
    assert t.speculate([1, 2, 3], 3, 0.5)[0] == [5, 6]
    drafts = t.speculate([1, 2, 3], 3, 0.1)[0]  # then 7 and 8 tie (1 of 2 each): one of them
    assert drafts[:2] == [5, 6] and drafts[2] in (7, 8)


def test_the_draft_with_most_expected_accepted_tokens_wins():
    t = suffix_tree_module().SuffixTree(8)
    t.extend(0, [5, 1, 2, 7])
    for s in range(1, 4):
        t.extend(s, [6, 2, 3, 4, 8])
    # "5 1 2" and "1 2" were followed by 7 once (1 expected token); "2" by 7 once and by 3 three times, then always
    # 4 and 8: 3 x 0.75 expected tokens
    assert t.speculate([5, 1, 2], 4, 0.3)[:3] == ([3, 4, 8], 1, pytest.approx(0.75))
    # capped at length_factor x the match's length, "2" drafts one token (0.75): the longest match's 7 wins
    assert t.speculate([5, 1, 2], 4, 0.3, length_factor=1.0) == ([7], 3, 1.0, [1.0])
    # a tie (both 1.0) goes to the longer match
    assert t.speculate([5, 1, 2], 4, 0.8, length_factor=1.0)[1] == 3


def _req(ids, n=0):
    r = Request(ids, SamplingParams(max_tokens=50))
    for t in range(n):
        r.append(100 + t)
    return r


def test_proposer_drafts_from_earlier_requests_and_evicts_oldest():
    p = SuffixProposer(max_depth=8, max_tokens=40, min_prob=0.5, min_match=1, length_factor=2.0)
    first = _req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert p.lookup(first, 4) == []  # a request's own text: nothing repeats yet
    p.finished(first)
    second = _req([20, 21, 1, 2, 3])
    assert p.lookup(second, 4) == [4, 5, 6, 7]  # the earlier request's continuation
    assert p.lookup(_req([30, 3]), 4) == [4, 5]  # a one-token match drafts at most length_factor x 1
    for i in range(5):  # 50 more tokens of finished requests: the oldest are evicted down to max_tokens
        r = _req([50 + 10 * i + j for j in range(10)])
        p.lookup(r, 1)
        p.finished(r)
    assert p.tree.num_tokens() <= 40 and p.tree.check()
    assert p.lookup(_req([40, 1, 2, 3]), 4) == []  # the first request is gone
    with pytest.raises(ValueError, match="min_prob"):
        SuffixProposer(min_prob=0)
    with pytest.raises(ValueError, match="length_factor"):
        SuffixProposer(length_factor=0)


def test_confidence_is_each_draft_given_the_ones_before_and_the_priced_drafts_are_proposed():
    p = SuffixProposer(max_depth=8, min_prob=0.1, length_factor=4.0)
    for i, tail in enumerate([[5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, 9]]):
        r = _req([1, 2, 3] + tail)
        p.lookup(r, 1)
        p.finished(r)
    r = _req([40, 1, 2, 3])
    assert p.free_drafts(r, 3) == 3 and p.lookup(r, 3) == [5, 6, 7]
    assert p.draft_confidence(r, 3) == pytest.approx([1.0, 3 / 4, 2 / 3])  # 4 of 4, then 3 of 4, then 2 of 3
    assert p.draft_confidence(r, 2) == pytest.approx([1.0, 3 / 4])
    assert p.confidence_group(r, 3) == 2  # the drafts continue a match of 3 tokens (1, 2, 3): groups 0-3 for 1-4+
    one = _req([40, 41, 3])  # only its last token, 3, occurred before
    assert p.lookup(one, 1) == [5] and p.confidence_group(one, 1) == 0
    assert p.confidence_group(_req([40, 41, 42]), 2) == 0  # no match, no drafts
    for _ in range(2):  # text that changes the draft, entering the tree mid-round (other rows')
        p.lookup(_req([1, 2, 3, 5, 6, 8, 8]), 1)
    assert p.lookup(_req([40, 1, 2, 3]), 3) == [5, 6, 8]
    assert p.lookup(r, 3) == [5, 6, 7] and p.lookup(r, 1) == [5]  # the round proposes what auto K priced
    r.append(5)
    assert p.lookup(r, 2)[0] == 6  # a new length: a new lookup



def test_a_requests_own_tree_drafts_what_its_own_text_holds():
    """The shared tree weighs a continuation among every request's; the request's own tree among its own text alone.
    After 7 8 six earlier requests wrote six different values (1/7 each in the shared tree: under min_prob, no draft)
    and this request wrote 50 51 once: its own tree drafts that, up to own_length_factor x the match's 2 tokens, in
    groups of their own (4-7), and forgets it when the request finishes."""
    p = SuffixProposer(max_depth=8, min_prob=0.3, length_factor=1.0, own_length_factor=2.0)
    for i in range(6):
        r = _req([7, 8, 100 + i, 9])
        p.lookup(r, 1)
        p.finished(r)
    r = _req([1, 2, 7, 8, 50, 51, 9, 3, 7, 8])
    assert p.lookup(r, 6) == [50, 51, 9, 3] and p.draft_confidence(r, 6) == pytest.approx([1.0] * 4)
    assert p.confidence_group(r, 6) == MATCH_GROUPS + 1  # a match of 2 tokens, in the request's own tree
    p.finished(r)
    assert p._rows[r].own is None  # its own tree went with it
    shared = SuffixProposer(max_depth=8, min_prob=0.3, length_factor=1.0, own_length_factor=None)
    for i in range(6):
        q = _req([7, 8, 100 + i, 9])
        shared.lookup(q, 1)
        shared.finished(q)
    assert shared.lookup(_req([1, 2, 7, 8, 50, 51, 9, 3, 7, 8]), 6) == []
    with pytest.raises(ValueError, match="own_length_factor"):
        SuffixProposer(own_length_factor=0)


def test_a_batchs_lookups_in_one_call_are_each_rows_lookup():
    """Auto K asks every row every round through Proposer.offers, which the suffix proposer answers with one C++
    call for the batch (lookup_rows). Its answers are what each row's own lookup in the shared and own trees gives
    (the more expected accepted tokens wins, the shared at a tie), round after round as the rows grow."""
    rnd = random.Random(2)
    p = SuffixProposer(max_depth=6, min_prob=0.2, length_factor=1.0, own_length_factor=2.0)
    ref = SuffixProposer(max_depth=6, min_prob=0.2, length_factor=1.0, own_length_factor=2.0)
    for _ in range(20):  # earlier requests' text, in both
        toks = [rnd.randrange(8) for _ in range(rnd.randint(5, 30))]
        for q in (p, ref):
            r = _req(toks)
            q.lookup(r, 1)
            q.finished(r)
    rows = [[rnd.randrange(8) for _ in range(rnd.randint(2, 20))] for _ in range(6)]
    mine, theirs = [_req(t) for t in rows], [_req(t) for t in rows]
    drafted = 0
    for step in range(12):
        ks = [rnd.choice([0, 1, 3, 5]) for _ in rows]
        got = p.offers(mine, ks)
        for b, (r, k) in enumerate(zip(theirs, ks)):
            if k == 0:
                assert got[b] is None
                continue
            row = ref._sync(r)
            d, m, _, probs = ref.tree.speculate_stored(row.seq, k, 0.2, 1, length_factor=1.0)
            group = max(0, min(m, MATCH_GROUPS) - 1)
            od, om, _, oprobs = row.own.speculate_stored(0, k, 0.2, 1, length_factor=2.0)
            if sum(oprobs) > sum(probs):
                d, probs, group = od, oprobs, MATCH_GROUPS + max(0, min(om, MATCH_GROUPS) - 1)
            cond = [x / (probs[j - 1] if j else 1.0) for j, x in enumerate(probs)]
            assert got[b][0] == len(d) and got[b][1] == pytest.approx(cond) and got[b][2] == group
            assert p.lookup(mine[b], k) == d  # the proposal is the draft priced
            drafted += len(d)
        for a, c in zip(mine, theirs):  # each row grows by 1-3 tokens
            for t in [rnd.randrange(8) for _ in range(rnd.randint(1, 3))]:
                a.append(t)
                c.append(t)
    assert drafted > 20  # the rows did find drafts


def test_engine_options_reach_the_proposer_and_bad_ones_are_named():
    """EngineConfig's suffix_* fields (the CLI's and server's --suffix-* flags) are the proposer's arguments, with the
    proposer's own defaults; a bad value, or a suffix_* option without proposer='suffix', is one clear error."""
    import inspect

    from infer.cli_args import SPEC_FIELDS
    from infer.engine.config import SUFFIX_DEFAULTS

    sig = inspect.signature(SuffixProposer)
    assert SUFFIX_DEFAULTS == {k: v.default for k, v in sig.parameters.items()}
    assert all("suffix_" + k in SPEC_FIELDS for k in SUFFIX_DEFAULTS)
    target = random_llama(64, seed=0)
    p = _engine(target, suffix_max_depth=6, suffix_min_prob=0.5, suffix_length_factor=1.5, suffix_min_match=2,
                suffix_own_length_factor=None, suffix_max_tokens=100).decoder.proposer
    assert (p.max_depth, p.min_prob, p.length_factor, p.min_match, p.own_length_factor, p.max_tokens) == \
        (6, 0.5, 1.5, 2, None, 100)
    for bad, match in ((dict(suffix_min_prob=0.0), "suffix_min_prob must be in"),
                       (dict(suffix_max_depth=1), "suffix_max_depth must be an integer >= 2"),
                       (dict(suffix_min_match=0), "suffix_min_match"),
                       (dict(suffix_own_length_factor=-1.0), "suffix_own_length_factor must be > 0")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", proposer="suffix", **bad)
    with pytest.raises(ValueError, match="suffix_min_prob: options of the suffix proposer.*proposer='ngram'"):
        EngineConfig(model="m", proposer="ngram", suffix_min_prob=0.5)


def test_token_trees_grow_best_first_under_the_counts():
    """speculate_tree_stored: from the chain's match, each node's `width` most frequent children best first by the
    path's probability (the context's own suffix left out of the match's count), >= min_prob, within the chain's cap;
    parents precede children. The proposer's tree holds the chain as its best path."""
    t = suffix_tree_module().SuffixTree(8)
    for i, seq in enumerate([[1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4, 7], [1, 2, 3, 5]]):
        t.extend(i, seq)
    t.extend(9, [8, 1, 2])  # the context: after 1 2 come 3 (3 of 4) then 5 (2 of 3) or 6, or 4 (1 of 4) then 7
    toks, parents, probs = t.speculate_tree_stored(9, 3, 2, 10, 0.1)
    assert toks == [3, 5, 4, 6, 7] and parents == [-1, 0, -1, 0, 2]  # at a tie, the node found first
    assert probs == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.25])
    assert t.speculate_tree_stored(9, 3, 1, 10, 0.1)[0] == [3, 5]  # width 1: the chain
    assert t.speculate_tree_stored(9, 3, 2, 3, 0.1)[0] == [3, 5, 4]  # a node budget
    assert t.speculate_tree_stored(9, 3, 2, 10, 0.3)[0] == [3, 5]  # min_prob on the path's probability
    assert t.speculate_tree_stored(9, 1, 2, 10, 0.1)[0] == [3, 4]  # depth 1
    assert t.speculate_tree_stored(9, 3, 2, 10, 0.1, length_factor=0.5)[0] == [3, 4]  # the cap: 0.5 x a match of 2
    assert t.speculate_tree_stored(77, 3, 2, 10, 0.1) == ([], [], [])  # no such sequence
    p = SuffixProposer(max_depth=8, min_prob=0.2, own_length_factor=None)
    for seq in ([1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4, 7], [1, 2, 3, 5]):
        r = _req(seq)
        p.lookup(r, 1)
        p.finished(r)
    r = _req([8, 1, 2])
    (tree,) = p.propose_tree(DraftBatch([r], [2], None, None, [None], 64, torch.device("cpu")), 2)
    chain = p.lookup(r, 2)
    assert chain == [3, 5]  # the tree's best path; its budget: depth x width nodes
    assert tree.tokens == [2, 3, 5, 4, 6] and tree.parents == [-1, 0, 1, 0, 1]
    assert tree.scores[1:] == pytest.approx([0.75, 0.5, 0.25, 0.25])

# -- losslessness through the engine ------------------------------------------------------------------------------
def _engine(target, **cfg):
    return Engine(EngineConfig(model="target", proposer="suffix", spec_length=3, block_size=4, **cfg), model=target)


def _repeating_prompts_decode_plainly(eng, target) -> None:
    """Two passes over 8 prompts that share a prefix (the second pass finds the first's outputs in the tree), batched:
    every output is plain decoding's."""
    rnd = random.Random(1)
    shared = [rnd.randrange(0, 64) for _ in range(6)]
    prompts = [shared + [rnd.randrange(0, 64) for _ in range(rnd.randrange(1, 8))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for _ in range(2):
        reqs = eng.run([eng.add_request(p, params, eos_token_ids=[]) for p in prompts])
        assert [r.output_ids for r in reqs] == [autoregressive_generate(target, p, params, eos_token_ids=[]).output_ids
                                                for p in prompts]


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_batched_greedy_parity_with_preemption(backend):
    """Requests that repeat each other's text (a shared prefix, loops): the tree drafts a lot, the output is plain
    decoding's, preempted or not."""
    target = random_llama(64, seed=0)
    kw = dict(num_kv_blocks=14) if backend == "paged" else dict(max_seq_len=60)
    eng = _engine(target, max_batch_size=6, kv_cache_backend=backend, **kw)
    _repeating_prompts_decode_plainly(eng, target)
    assert eng.stats.num_accepted_tokens > 50
    if backend == "paged":
        assert eng.stats.num_preemptions > 0
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_output_does_not_depend_on_the_tree():
    """A request's greedy output is the same token for token with the tree empty and full of other requests' text
    (drafts are proposals only). Sampled, the law is the same (the chi-square tests below); the tokens of one seed
    may differ, since drafts change which uniform judges which token."""
    target = random_llama(64, seed=0)
    probe = [3, 9, 27, 17, 51, 25]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    empty = _engine(target, max_batch_size=4)
    (alone,) = empty.run([empty.add_request(probe, params, eos_token_ids=[])])
    full = _engine(target, max_batch_size=4)
    others = [probe[:3] + [rnd] * 5 + probe[3:] for rnd in range(10)]  # other users' text around the same tokens
    full.run([full.add_request(o, params, eos_token_ids=[]) for o in others])
    assert full.decoder.proposer.tree.num_tokens() > 300
    (crowded,) = full.run([full.add_request(probe, params, eos_token_ids=[])])
    assert crowded.output_ids == alone.output_ids
    assert crowded.num_draft_tokens > 0  # the tree did propose


def test_a_predicted_output_is_copied_and_changes_nothing_but_speed():
    """OpenAI's predicted outputs: token ids the output is expected to repeat enter the request's own tree after the
    prompt's tail, so its drafts copy them from the first output token on, and again after an edit. The output is
    plain decoding's with any prediction: the expected one drafts most tokens, a wrong one is rejected."""
    target = random_llama(64, seed=0)
    prompt = [3, 9, 27, 17, 51, 25]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids
    edited = want[:15] + [want[15] ^ 1, 60, 61] + want[16:]  # a token changed and two inserted in the middle
    seen = {}
    for name, prediction in (("none", None), ("exact", want), ("edited", edited), ("wrong", [7] * 40)):
        eng = _engine(target, max_batch_size=1)
        (r,) = eng.run([eng.add_request(prompt, params, eos_token_ids=[], prediction=prediction)])
        assert r.output_ids == want, name
        seen[name] = (r.num_accepted_tokens, r.num_target_forwards)
    assert seen["exact"][0] >= 25 and seen["exact"][1] <= 13  # ~3.5 tokens a forward (K = 3) against 1
    assert seen["edited"][0] >= 20 and seen["none"][0] <= 6 and seen["wrong"][0] <= 6
    with pytest.raises(ValueError, match="prediction token ids"):
        _engine(target).add_request(prompt, params, prediction=[1, 64])


LATER = SamplingParams(temperature=1.0, max_tokens=4)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def _pvalue(backend, hybrid=False, **cfg):
    """hybrid: "suffix-hybrid" with a random draft model; the tree copies wherever it has a draft after a match of 2+
    tokens, so a round holds rows of both kinds (a first token that continues the prompt's text: copies; another: the
    model's draws)."""
    target = random_llama(V, seed=0)
    extra = dict(proposer="suffix")
    if hybrid:
        extra = dict(draft_model="drafter", proposer="suffix-hybrid", suffix_min_match=2, suffix_min_score=0.0)
    eng = Engine(EngineConfig(model="target", spec_length=2, max_batch_size=32, block_size=4, seed=1234,
                              kv_cache_backend=backend, **extra, **cfg), model=target,
                 draft_model=random_llama(V, seed=5) if hybrid else None)
    if hybrid:
        asked = _count_model_rows(eng)
    reqs = [eng.add_request(PROMPT, LATER) for _ in range(N)]
    eng.run(reqs)
    if hybrid:
        assert asked[0] > N // 10 and asked[1] > N // 10  # rows the model drafted for, and rows that copied
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert eng.stats.num_draft_tokens > N // 2  # the tree drafted (the prompt, then earlier requests' outputs)
    assert eng.stats.tree_rounds > 0 if cfg.get("spec_tree") else eng.stats.tree_rounds == 0
    return chi2_pvalue(counts, exact_joint(target, LATER, first=2, prompt=PROMPT))


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_joint_law_is_exact(backend):
    assert _pvalue(backend) > 0.001


def test_lossy_rule_is_caught():
    assert _pvalue("paged", acceptance="skip_adjustment") < 1e-4


def test_joint_law_is_exact_over_token_trees():
    """Tree rounds (depth 2, two children a node, deterministic siblings from the tree's counts): still the target's
    law; keeping p for every sibling instead of the residual (the shortcut tree_verify documents) is caught."""
    assert _pvalue("paged", spec_tree="2x2") > 0.001


def test_lossy_tree_rule_is_caught(monkeypatch):
    import functools

    from infer.spec_decode import tree_round as tree_round_module
    from infer.spec_decode.tree_verify import tree_verify

    monkeypatch.setattr(tree_round_module, "tree_verify", functools.partial(tree_verify,
                                                                            wrong_independent_acceptance=True))
    assert _pvalue("paged", spec_tree="2x2") < 1e-4


def _count_model_rows(eng) -> list[int]:
    """[rows the hybrid's model drafted for, rows it copied for], counted as the engine runs."""
    hyb, seen = eng.decoder.proposer, [0, 0]
    propose = hyb.model.propose

    def counted(batch):
        seen[0] += len(batch.reqs)
        return propose(batch)

    def hybrid_propose(batch, _orig=hyb.propose):
        out = _orig(batch)
        seen[1] += sum(out.free)
        return out
    hyb.model.propose, hyb.propose = counted, hybrid_propose
    return seen


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_suffix_hybrid_greedy_parity_with_preemption(backend):
    """suffix-hybrid: rows whose context the tree continues copy, the others take the draft model's drafts, in the
    same rounds; the output is plain decoding's, preempted or not, and both kinds of drafts were proposed."""
    target, drafter = random_llama(64, seed=0), random_llama(64, seed=0, noise_from=0, noise=0.3)
    kw = dict(num_kv_blocks=16) if backend == "paged" else dict(max_seq_len=60)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", proposer="suffix-hybrid", spec_length=3,
                              block_size=4, max_batch_size=6, kv_cache_backend=backend, **kw),
                 model=target, draft_model=drafter)
    assert eng.decoder.proposer.name == "suffix-hybrid"
    asked = _count_model_rows(eng)
    _repeating_prompts_decode_plainly(eng, target)
    assert asked[0] > 0 and asked[1] > 0 and eng.stats.num_accepted_tokens > 50
    assert eng.decoder.proposer.copies.tree.num_tokens() > 300  # finished requests' text stays for the next ones
    if backend == "paged":
        assert eng.stats.num_preemptions > 0
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_suffix_hybrid_prices_copies_by_the_trees_confidence():
    """The hybrid's offers are the tree's (drafts, confidences, group) where it has a copy, None (a model row, priced
    with draft steps) where it has none; the proposal copies there and asks the model for the rest only."""
    from infer.proposers.base import Proposal
    from infer.proposers.ngram import HybridProposer

    class Model:
        uses_draft_model = uses_features = supports_tree = False
        asked = []

        def propose(self, batch):
            self.asked.append([r.prompt_ids for r in batch.reqs])
            return Proposal(torch.tensor([[9, 8, 7][:batch.K]] * len(batch.reqs)), list(batch.ks), None)

        def finished(self, req):
            pass

    tree = SuffixProposer()
    hyb = HybridProposer(tree, model := Model(), "suffix-hybrid")
    seen = Request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=10))
    tree.lookup(seen, 1)  # a round's lookup feeds a request's text to the tree
    hyb.finished(seen)  # and it stays there for the next requests
    copying = Request([7, 1, 2], SamplingParams(temperature=0, max_tokens=10))
    fresh = Request([40, 41], SamplingParams(temperature=0, max_tokens=10))
    offers = hyb.offers([copying, fresh], [3, 3])
    assert offers[0] == tree.offers([copying], [3])[0] and offers[0][0] == 2 and offers[0][1] is not None
    assert offers[1] is None
    assert hyb.draft_confidence(copying, 3) == tree.draft_confidence(copying, 3)
    out = hyb.propose(DraftBatch([copying, fresh], [3, 3], None, None, [None, None], 64, torch.device("cpu")))
    assert out.drafts[0, :2].tolist() == [3, 4] and out.drafts[1].tolist() == [9, 8, 7]
    assert out.free == [True, False] and model.asked == [[[40, 41]]]
    # a copy the tree expects fewer than min_copy_score of its drafts accepted from goes to the model instead
    hyb.min_copy_score = 2.5  # [3, 4] after "1 2": each sure (1.0): 2.0 expected
    assert hyb.offers([copying], [3]) == [None] and hyb.free_drafts(copying, 3) is None
    out = hyb.propose(DraftBatch([copying], [3], None, None, [None], 64, torch.device("cpu")))
    assert out.drafts[0].tolist() == [9, 8, 7] and out.free == [False]
    # auto K decides at the row's cap and may propose fewer: the copy priced is the copy proposed
    hyb.min_copy_score = 1.5
    assert hyb.offers([copying], [3])[0][0] == 2  # [3, 4]: 2.0 expected
    out = hyb.propose(DraftBatch([copying], [1], None, None, [None], 64, torch.device("cpu")))
    assert out.drafts[0].tolist() == [3] and out.free == [True]  # [3] alone would score 1.0
    hyb.clear()
    assert tree.tree.num_tokens() == 0


def test_suffix_hybrid_options_are_checked():
    with pytest.raises(ValueError, match="needs a draft_model"):
        EngineConfig(model="m", proposer="suffix-hybrid")
    cfg = EngineConfig(model="m", draft_model="d", proposer="suffix-hybrid", suffix_min_prob=0.5)
    assert cfg.suffix_options["min_prob"] == 0.5 and cfg.draft_vocab_size == "auto"
    with pytest.raises(ValueError, match="suffix_min_prob"):
        EngineConfig(model="m", draft_model="d", proposer="suffix-hybrid", suffix_min_prob=1.5)
    with pytest.raises(ValueError, match="suffix_min_score must be a number >= 0"):
        EngineConfig(model="m", draft_model="d", proposer="suffix-hybrid", suffix_min_score=-1)
    with pytest.raises(ValueError, match="only proposer='suffix-hybrid'"):
        EngineConfig(model="m", proposer="suffix", suffix_min_score=2.0)
    eng = Engine(EngineConfig(model="t", draft_model="d", proposer="suffix-hybrid", suffix_min_score=0.5,
                              suffix_min_prob=0.4), model=random_llama(16), draft_model=random_llama(16, seed=1))
    assert eng.decoder.proposer.min_copy_score == 0.5 and eng.decoder.proposer.copies.min_prob == 0.4


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_suffix_hybrid_joint_law_is_exact(backend):
    assert _pvalue(backend, hybrid=True) > 0.001


def test_suffix_hybrid_lossy_rule_is_caught():
    assert _pvalue("paged", hybrid=True, acceptance="skip_adjustment") < 1e-4


def _declining_pvalue(**cfg):
    """suffix-hybrid under auto K, with a drafter close to the target and draft steps priced cheap (the costs held,
    not refreshed from this machine's timings): auto K declines many of the tree's copies for the model's draws
    (GoodputSpecLength.decline), so rows that could copy are drafted by the model, beside copying rows."""
    from infer.spec_decode.cost_model import CostModel

    target = random_llama(V, seed=0)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", proposer="suffix-hybrid", spec_length="auto",
                              spec_length_max=3, suffix_min_match=2, suffix_min_score=0.0, max_batch_size=32,
                              block_size=4, seed=1234, **cfg),
                 model=target, draft_model=random_llama(V, seed=0, noise_from=0, noise=0.3))
    sl = eng.decoder.spec_length
    sl.costs = CostModel.from_points(32, 3, {(1, 1): 1e-3, (1, 4): 1.3e-3, (32, 1): 1e-3, (32, 4): 2e-3},
                                     {1: 1e-5, 32: 2e-5})
    sl.drafted = sl.timed = sl.caught_up = sl.round_overhead = lambda *a: None
    declined, decline = [], sl.decline
    sl.decline = lambda r: declined.append(r) or decline(r)
    asked = _count_model_rows(eng)
    reqs = [eng.add_request(PROMPT, LATER) for _ in range(N)]
    eng.run(reqs)
    assert len(declined) > N // 20 and asked[0] > N // 10 and asked[1] > N // 10
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    return chi2_pvalue(counts, exact_joint(target, LATER, first=2, prompt=PROMPT))


def test_suffix_hybrid_joint_law_is_exact_where_auto_k_declines_copies():
    assert _declining_pvalue() > 0.001
    assert _declining_pvalue(acceptance="skip_adjustment") < 1e-4
