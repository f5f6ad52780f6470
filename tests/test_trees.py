"""Token trees end to end: the tree-attention forward in both KV backends (every node's state equals the state of its
path run as a chain, and the compacted path decodes on as the chain does), tree shapes and growth, greedy parity
per proposer on both backends and in a batch that preempts, the exact law under sampling through the batched engine,
a wrong tree sampler caught by the same test, the switch and its errors, and "auto" falling back to chains beside
other requests."""

import functools
import random

import pytest
import torch

from infer.cache import PagedKVCachePool, SlottedKVCache
from infer.cache.base import TreeAttn
from infer.engine import Engine, EngineConfig
from infer.generate import autoregressive_generate
from infer.request import Request
from infer.sampling import SamplingParams
from infer.spec_decode import tree_round as tree_round_module
from infer.spec_decode.tree import DraftTree, TreeShape, grow
from infer.spec_decode.tree_verify import ancestor_mask, tree_depths, tree_verify
from infer.testing import random_heads, random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint

# a tree below the root g: nodes 1, 2 at depth 1; 3, 4 under 1; 5 under 2; 6 under 4
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def _pool(backend, model, slots=3):
    if backend == "paged":
        return PagedKVCachePool.for_model(model, num_blocks=24, block_size=4, max_seq_len=32, max_slots=slots)
    return SlottedKVCache.for_model(model, max_seq_len=32, max_slots=slots)


def _run(model, pool, slot, tokens, tree=None):
    meta = pool.prepare([slot], [len(tokens)], tree=tree)
    return model(torch.tensor([tokens]), meta.positions, pool, meta)[0]


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@torch.inference_mode()
def test_tree_forward_equals_each_path_as_a_chain_and_compacts(backend):
    model = random_llama(64, seed=0)
    prompt, tokens = [5, 9, 2, 7, 1], [3, 11, 12, 13, 14, 15, 16]  # node 0 is g = 3, the last token
    pool = _pool(backend, model)
    tree_slot = pool.allocate()
    _run(model, pool, tree_slot, prompt)
    parents = torch.tensor([PARENTS])
    L1 = len(prompt)  # the root's position
    attn = TreeAttn(L1 + tree_depths(parents), [L1], ancestor_mask(parents))
    hidden = _run(model, pool, tree_slot, tokens, attn)  # [7, H]
    for i in range(len(tokens)):
        path, u = [], i
        while u >= 0:
            path.insert(0, tokens[u])
            u = PARENTS[u]
        chain = pool.allocate()
        _run(model, pool, chain, prompt)
        for t in path:  # plain decoding, one token a step
            want = _run(model, pool, chain, [t])[0]
        assert torch.equal(hidden[i], want), i  # bit-identical: same keys, same order, same positions
        pool.free(chain)
    # accept the path 0 -> 1 -> 4 -> 6: move nodes 4 and 6 (columns L1+4, L1+6) behind node 1, drop the rest
    pool.move(tree_slot, [L1 + 1, L1 + 4, L1 + 6], [L1 + 1, L1 + 2, L1 + 3])
    pool.truncate_to(tree_slot, L1 + 4)
    chain = pool.allocate()
    _run(model, pool, chain, prompt)
    _run(model, pool, chain, [3, 11, 14, 16])  # a verify-shaped chain of the accepted path
    assert torch.equal(_run(model, pool, tree_slot, [42]), _run(model, pool, chain, [42]))  # decodes on as the chain


def test_shapes_parse_and_refuse():
    assert str(TreeShape.parse("4x3")) == "4x3:12" and TreeShape.parse("5 x 3 : 9").budget == 9
    assert TreeShape.parse("8x4").budget == 15  # a verify row holds 16 tokens
    for bad in ("4", "x3", "0x3", "4x3:13", "4x3:0"):
        with pytest.raises(ValueError, match="spec_tree"):
            TreeShape.parse(bad)


def test_prune_keeps_the_best_nodes_as_a_tree():
    t = DraftTree(9)
    a, b = t.add(0, 1, -0.1), t.add(0, 2, -2.0)
    c = t.add(a, 3, -0.5)
    t.add(c, 4, -3.0)
    t.add(b, 5, -2.5)
    assert t.add(0, 1, -0.05) == a  # an equal child is merged, keeping the better score
    kept = t.prune(3)
    assert kept.tokens == [9, 1, 2, 3] and kept.parents == [-1, 0, 0, 1]
    assert t.prune(5, max_depth=2).tokens == [9, 1, 2, 3, 5]
    t.add_path([1, 3, 7], score=0.0)  # an n-gram's chain merges into the existing nodes
    assert t.tokens[-1] == 7 and t.parents[-1] == c


def test_grow_keeps_the_best_paths_per_depth():
    # the drafter's log probs: after the root token 0 -> top children 1 (-0.1), 2 (-1.0); every node's children are
    # (its token * 10 + 1, -0.2) and (its token * 10 + 2, -2.0)
    first = (torch.tensor([[-0.1, -1.0]]), torch.tensor([[1, 2]]))
    seen = []

    def step(tok, parent_slot):
        seen.append(tok.tolist())
        vals = torch.tensor([-0.2, -2.0]).expand(1, tok.shape[1], 2)
        return vals, torch.stack([tok * 10 + 1, tok * 10 + 2], -1)

    tree = DraftTree(0)
    grow([tree], first, step, [3], width=2)
    # depth 2: 11 (-0.3), 21 (-1.2) beat 12 (-2.1), 22 (-3.0); depth 3: 111 (-0.5), 211 (-1.4)
    assert seen == [[[1, 2]], [[11, 21]]]
    assert tree.tokens == [0, 1, 2, 11, 21, 111, 211] and tree.parents == [-1, 0, 0, 1, 2, 3, 4]


def _drafters(target, kind):
    if kind in ("eagle", "medusa"):
        return random_heads(target, kind, seed=3), "draft"
    if kind in ("ngram", "suffix"):
        return None, kind
    # a drafter close to the target: long accepted paths, often off the first child (compaction moves entries)
    return random_llama(target.config.vocab_size, seed=1, noise_from=0, noise=0.15), \
        "hybrid" if kind == "hybrid" else "draft"


def _engine(target, kind, **cfg):
    drafter, proposer = _drafters(target, kind)
    return Engine(EngineConfig(model="target", draft_model=None if drafter is None else "drafter", proposer=proposer,
                               **cfg), model=target, draft_model=drafter)


class _Moves:
    """Counts compactions that moved entries (accepted paths off the first children)."""

    def __init__(self, pool):
        self.n, self._move = 0, pool.move
        pool.move = self

    def __call__(self, slot, src, dst):
        self.n += src != dst
        self._move(slot, src, dst)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("kind", ["draft", "eagle", "medusa", "ngram", "hybrid", "suffix"])
def test_greedy_parity(kind, backend):
    target = random_llama(64, seed=0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3], [5, 1, 7, 2, 2, 0, 3, 4, 6, 1, 5, 2, 7, 3, 0, 1, 1, 2, 6, 4, 3, 5, 1, 7]]  # > 16: fed alone
    for tree, k in (("4x3", 4), ("3x2:4", 3)):  # auto K may pick K = 0 here (a tiny target costs what its drafter does)
        eng = _engine(target, kind, spec_length=k, spec_tree=tree, kv_cache_backend=backend, max_batch_size=1)
        moves = _Moves(eng.kv.pool)
        for prompt in prompts:
            want = autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids
            assert eng.run([eng.add_request(prompt, params, eos_token_ids=[])])[0].output_ids == want, tree
        assert eng.stats.tree_rounds > 0 and eng.free_kv_tokens() == eng.initial_free_kv_tokens
        if kind == "draft" and tree == "4x3":
            assert moves.n > 0 and sum(eng.stats.accepted_per_position[1:]) > 0  # paths of 2+ off the first child



@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft"])
def test_tree_rounds_report_copies_as_free_drafts(kind):
    """Auto K counts copied drafts (n-gram, suffix tree) apart from a model's and calibrates their confidences: a tree
    round says which its rows were, as a chain round does."""
    target = random_llama(64, seed=0)
    eng = _engine(target, kind, spec_length=3, spec_tree="3x2", max_batch_size=1)
    seen = []
    eng.decoder.spec_length.observe = lambda req, k, n, logits=None, free=False: seen.append((k, free))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng.run([eng.add_request([1, 2, 3, 1, 2, 3, 1, 2], params, eos_token_ids=[])])
    judged = [free for k, free in seen if k]
    assert eng.stats.tree_rounds > 0 and judged
    assert all(judged) if kind != "draft" else not any(judged)

@pytest.mark.parametrize("kind", ["draft", "eagle", "suffix"])
def test_batched_greedy_parity_with_preemption(kind):
    target = random_llama(64, seed=0)
    eng = _engine(target, kind, spec_length=3, spec_tree="3x3:8", max_batch_size=6, num_kv_blocks=24, block_size=4)
    rnd = random.Random(1)
    prompts = [[rnd.randrange(0, 64) for _ in range(rnd.randrange(3, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = eng.run([eng.add_request(p, params, eos_token_ids=[]) for p in prompts])
    assert [r.output_ids for r in reqs] == [autoregressive_generate(target, p, params, eos_token_ids=[]).output_ids
                                            for p in prompts]
    assert eng.stats.num_preemptions > 0 and eng.stats.tree_rounds > 0
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


PARAMS = [SamplingParams(temperature=1.0, max_tokens=4),
          SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.7, logit_bias={3: 1.0}, max_tokens=4)]  # a node's penalties count
# the drafts on its path
PROMPT = [1, 2]


def _pvalue(kind, params, backend="paged", banned=()):
    """N concurrent requests, batched tree rounds: token 1 from the prefill, tokens 2 and 3 from one tree round
    (depth 2, two children a node) -> the chi-square p-value of (x2, x3) against the target's exact joint."""
    target = random_llama(V, seed=0)
    eng = _engine(target, kind, spec_length=2, spec_tree="2x2", max_batch_size=32, block_size=4, seed=1234,
                  kv_cache_backend=backend)
    reqs = eng.run([eng.add_request(PROMPT, params) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    assert eng.stats.tree_rounds > 0 and 0.1 < eng.stats.acceptance_rate < 0.95  # children judged, often rejected
    return chi2_pvalue(counts, exact_joint(target, params, first=2, prompt=PROMPT, banned=banned))


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p+penalties"])
@pytest.mark.parametrize("kind", ["draft", "medusa"])
def test_joint_distribution_equals_target(kind, params, backend):
    assert _pvalue(kind, params, backend) > 0.001


def test_joint_distribution_with_min_tokens():
    """min_tokens in tree rounds: a node at depth d stands for the row's next token + d, masked while that comes before
    the minimum (the stop is the target's likeliest first token)."""
    target = random_llama(V, seed=0)
    with torch.no_grad():
        stop = int(target.compute_logits(target(torch.tensor([PROMPT])))[0, -1].argmax())
    params = SamplingParams(temperature=1.0, max_tokens=4, min_tokens=3, stop_token_ids=[stop])
    assert _pvalue("draft", params, banned=[stop]) > 0.001


def test_wrong_tree_sampler_is_detected(monkeypatch):
    # accept each child with probability p(t) on its own, never taking the rejected ones out of p: lossy
    monkeypatch.setattr(tree_round_module, "tree_verify", functools.partial(tree_verify,
                                                                            wrong_independent_acceptance=True))
    assert _pvalue("draft", PARAMS[0]) < 1e-4


def test_auto_trees_for_a_lone_request_chains_beside_others():
    target = random_llama(64, seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = _engine(target, "draft", spec_length=3, spec_tree="auto", max_batch_size=4)
    eng.run([eng.add_request([1, 2, 3], params, eos_token_ids=[])])
    alone = eng.stats.tree_rounds
    assert alone > 0
    eng.run([eng.add_request([4, 5, 6, 7], params, eos_token_ids=[]) for _ in range(3)])
    assert eng.stats.tree_rounds == alone and eng.stats.num_drafts > alone  # three rows: chains only


def test_auto_follows_the_cost_model():
    """With a cost model (auto K), "auto" drafts a tree of the chain's K nodes at least, and more where the cost model
    prices the wider verify about as the chain's: a flat cost (a memory-bound target) gets 12 nodes at K = 4, a cost
    that grows with the tokens (this CPU's int8 verify, a batch) 4."""
    from infer.spec_decode.cost_model import CostModel

    target = random_llama(64, seed=0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for slope, budget in ((0.0, 12), (0.3, 4)):
        eng = _engine(target, "draft", spec_length="auto", spec_length_max=4, spec_tree="auto", max_batch_size=1)
        costs = CostModel.from_points(1, 15, {(1, t): 1e-3 * (1 + slope * (t - 1)) for t in (1, 2, 16)}, {1: 1e-6})
        eng.decoder.spec_length.costs = costs
        shape = eng.decoder.tree_shape([Request([1, 2, 3], params)], 4)
        assert (shape.depth, shape.width, shape.budget) == (4, 3 if budget == 12 else 2, budget)  # lookahead 15
        want = autoregressive_generate(target, [1, 2, 3], params, eos_token_ids=[]).output_ids
        assert eng.run([eng.add_request([1, 2, 3], params, eos_token_ids=[])])[0].output_ids == want
        assert eng.stats.tree_rounds > 0
        two = [Request([1, 2, 3], params), Request([4, 5], params)]  # beside another row: more nodes, or a chain
        assert (eng.decoder.tree_shape(two, 4) is None) == (budget == 4)


def test_library_call_and_debug_view_show_tree_rounds():
    from infer.speculative import speculative_generate
    from infer.spec_decode.debug import format_round

    target = random_llama(64, seed=0)
    drafter, _ = _drafters(target, "draft")
    params = SamplingParams(temperature=0, max_tokens=20)
    records = []
    out, stats = speculative_generate(target, drafter, [1, 2, 3], params, spec_length=3, spec_tree="3x2",
                                      eos_token_ids=[], debug=lambda rec, req: records.append(rec))
    assert out.output_ids == autoregressive_generate(target, [1, 2, 3], params, eos_token_ids=[]).output_ids
    assert records and all(0 < r.nodes <= 6 and r.k <= 3 for r in records)
    assert stats.expected_acceptance is None  # trees report no E[accept] (it is a chain's quantity)
    line = format_round(1, records[0], str, color=False)
    assert line.startswith(f"round   1 tree of {records[0].nodes} nodes, depth {records[0].k}")


def test_switch_errors_name_the_problem():
    with pytest.raises(ValueError, match="turn speculation on"):
        EngineConfig(model="m", spec_tree="4x3")
    with pytest.raises(ValueError, match="chains only"):
        EngineConfig(model="m", proposer="ngram", spec_tree="4x3", acceptance="typical")
    with pytest.raises(ValueError, match="DEPTHxWIDTH"):
        EngineConfig(model="m", proposer="ngram", spec_tree="wide")
    assert EngineConfig(model="m", proposer="ngram", spec_tree="5x3").max_spec_length == 15  # the lookahead
