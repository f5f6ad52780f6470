"""Bad words and allowed tokens (vLLM's ``bad_words`` / ``allowed_token_ids``; infer.token_bans): the matching rule,
vLLM's tokenization of a word, the bans at every verified position (chain and tree), the parameters' refusals, greedy
parity of plain, speculating and token-by-token decoding, and the exact joint law of two tokens under sampling
through the batched engine on both KV backends, with a draft vocabulary that holds none of the allowed tokens, and
in tree rounds; a verify that skips the ban is caught by the same test."""

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.generate import autoregressive_generate
from infer.proposers.draft_vocab import DraftVocab
from infer.request import Request
from infer.sampling import SamplingBatch, SamplingParams, logits_to_probs
from infer.spec_decode import round as round_module
from infer.spec_decode.tree import DraftTree
from infer.testing import random_llama
from infer.token_bans import ban_bad_words_, bad_words_ids, banned_after, chain_drafted, tree_drafted
from infer.tokenizer import Tokenizer

from test_spec_distribution import N, V, _next, chi2_pvalue


def test_a_word_is_banned_where_the_output_ends_in_its_other_tokens():
    words = [[5], [1, 2], [3, 4, 6]]
    assert banned_after(words, []) == [5]
    assert banned_after(words, [7, 1]) == [5, 2]
    assert banned_after(words, [3, 4]) == [5, 6]
    assert banned_after(words, [4]) == [5]  # [3, 4, 6] needs both of 3, 4
    assert banned_after(words, [1, 3]) == [5]


def test_each_verified_position_sees_the_output_and_the_drafts_before_it():
    r = Request([9, 9], SamplingParams(bad_words=[[1, 2], [3]]))
    r.output_ids = [0, 1]
    logits = torch.zeros(1, 4, 8)
    ban_bad_words_(logits, [r], chain_drafted([[2, 1, 5]]))  # position t follows output + drafts[:t]
    banned = [torch.isinf(logits[0, t]).nonzero()[:, 0].tolist() for t in range(4)]
    assert banned == [[2, 3], [3], [2, 3], [3]]
    two = torch.zeros(1, 8)
    ban_bad_words_(two, [r])  # a decode step: after the output alone
    assert torch.isinf(two[0]).nonzero()[:, 0].tolist() == [2, 3]
    # a tree: node i follows the drafts on its path (itself included, the root not)
    tree = DraftTree(root=1, tokens=[1, 5, 1, 7], parents=[-1, 0, 0, 2])
    assert tree_drafted([tree]) == [[[], [5], [1], [1, 7]]]
    r.output_ids = [0]
    logits = torch.zeros(1, 4, 8)
    ban_bad_words_(logits, [r], tree_drafted([tree]))
    assert [torch.isinf(logits[0, t]).nonzero()[:, 0].tolist() for t in range(4)] == [[3], [3], [2, 3], [3]]


def test_a_ban_that_would_leave_no_allowed_token_is_not_applied():
    r = Request([9], SamplingParams(bad_words=[[1, 2]], allowed_token_ids=[2]))
    r.output_ids = [1]
    logits = torch.zeros(1, 8)
    ban_bad_words_(logits, [r])
    assert not torch.isinf(logits).any()


def test_a_word_as_text_is_tokenized_as_vllm_does(gqa_dir):
    tok = Tokenizer(gqa_dir)
    for word in ("hello", "  world", "Paris"):
        plain = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        assert bad_words_ids([word], tok) == want
    assert bad_words_ids([[4, 5]], None) == [[4, 5]]
    with pytest.raises(ValueError, match="no tokenizer"):
        bad_words_ids(["hello"], None)
    with pytest.raises(ValueError, match="tokenizer"):
        Request([1], SamplingParams(bad_words=["hello"]))


@pytest.mark.parametrize("kw, match", [
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=[[]]), "bad_words"), (dict(bad_words=[[1, -2]]), "bad_words"),
    (dict(bad_words=5), "bad_words"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids"), (dict(allowed_token_ids=[True]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1], structured={"regex": "a"}), "allowed_token_ids"),
    (dict(bad_words=["a"], structured={"regex": "a"}), "bad_words")])
def test_bad_parameters_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
        SamplingParams(**kw)


def test_the_engine_refuses_what_leaves_no_token():
    eng = Engine(EngineConfig(model="t"), model=random_llama(V, seed=0))
    for params, match in ((SamplingParams(allowed_token_ids=[3, V]), "allowed_token_ids names token 8"),
                          (SamplingParams(bad_words=[[1, V]]), "bad_words names token 8"),
                          (SamplingParams(bad_words=[[2], [3]], allowed_token_ids=[2, 3]), "ban every one"),
                          (SamplingParams(min_tokens=2, stop_token_ids=[4], allowed_token_ids=[4]), "holds back"),
                          (SamplingParams(bad_words=["word"]), "no tokenizer")):
        with pytest.raises(ValueError, match=match):
            eng.add_request([1, 2], params)
    assert not eng.requests


def test_allowed_tokens_hold_all_the_mass_and_a_draft_vocabulary_without_them_drafts_unbiased():
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0.8, allowed_token_ids=[1, 4], logit_bias={4: 2.0, 5: 3.0}),
              SamplingParams(temperature=0.8)]
    batch = SamplingBatch.from_params(params, V, "cpu")
    probs = logits_to_probs(logits, batch)
    assert probs[0, [0, 2, 3, 5, 6, 7]].sum() == 0 and torch.allclose(probs[1], (logits[1] / 0.8).softmax(-1))
    want = torch.tensor([logits[0, 1], logits[0, 4] + 2.0]).div(0.8).softmax(-1)
    assert torch.allclose(probs[0, [1, 4]], want)
    sub = batch.over(torch.tensor([0, 2, 3]))  # none of row 0's allowed tokens: its draft law is the drafter's own
    assert not torch.isinf(sub.logit_bias).any() and (sub.logit_bias == 0).all()
    assert torch.isinf(batch.over(torch.tensor([0, 1])).logit_bias[0, 0])  # token 1 there: 0 stays out
    greedy = SamplingBatch.from_params([SamplingParams(temperature=0, allowed_token_ids=[2, 6])], V, "cpu")
    assert logits_to_probs(logits[:1], greedy)[0].argmax() == [2, 6][int(logits[0, 6] > logits[0, 2])]


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_greedy_parity_plain_speculating_and_token_by_token(models, backend):
    """The same bans give the same greedy output in a plain engine, a speculating one (chains, and trees on the paged
    pool) and autoregressive_generate; no banned word is ever completed, and allowed tokens are all there is."""
    target, drafter, tok = models
    prompt = [(7 * j) % 200 + 5 for j in range(11)]
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    cfg = dict(model="t", kv_cache_backend=backend, block_size=4)
    plain = Engine(EngineConfig(**cfg), model=target, tokenizer=tok)
    spec = Engine(EngineConfig(**cfg, draft_model="drafter", spec_length=3, **(
        {"spec_tree": "2x2"} if backend == "paged" else {})), model=target, draft_model=drafter, tokenizer=tok)
    free = plain.run([plain.add_request(prompt, SamplingParams(**greedy))])[0].output_ids
    words = [[free[1]], [free[4], free[5]], tok.decode([free[8]]).strip() or [free[8]]]
    for params in (SamplingParams(**greedy, bad_words=words),
                   SamplingParams(**greedy, allowed_token_ids=sorted(set(free[::2]) | {3, 17})),
                   SamplingParams(**greedy, bad_words=[[free[2]]], allowed_token_ids=sorted(set(free)))):
        want = plain.run([plain.add_request(prompt, params)])[0].output_ids
        assert want != free
        assert spec.run([spec.add_request(prompt, params)])[0].output_ids == want
        assert autoregressive_generate(target, prompt, params, eos_token_ids=[], tokenizer=tok).output_ids == want
        if params.allowed_token_ids:
            assert set(want) <= set(params.allowed_token_ids)
        for w in bad_words_ids(params.bad_words or [], tok):
            assert not any(want[i:i + len(w)] == w for i in range(len(want)))
    assert spec.stats.num_drafts > 0 and (backend == "contiguous" or spec.stats.tree_rounds > 0)


# -- the exact law under sampling ----------------------------------------------------------------------------------
def joint_of(nxt, prompt, first):
    """P(x_first, x_first+1 | prompt) [V, V] from ``nxt(seq)``, the law of the token after seq [V]."""
    p1 = nxt(prompt)
    if first == 1:
        return p1[:, None] * torch.stack([nxt(prompt + [a]) for a in range(V)])
    out = torch.zeros(V, V)
    for a in range(V):
        p2 = nxt(prompt + [a])
        out += p1[a] * p2[:, None] * torch.stack([nxt(prompt + [a, b]) for b in range(V)])
    return out


def _joint(target, params, words, prompt, first):
    """The exact law under the pipeline with each position's bans (the output before it)."""
    n = len(prompt)
    return joint_of(lambda seq: _next(target, [seq], params, n, banned_after(words, seq[n:]) if words else ())[0],
                    prompt, first)


def engine_pvalue(params, joint, dv_ids=None, tree=False, **cfg):
    """N concurrent sampled requests: the first two tokens of a one-token prompt come from one chain round (with a
    tree: tokens 2 and 3 of a two-token prompt from one tree round) -> the chi-square p-value against the exact
    joint ``joint(target, prompt, first)``, 0.0 where a pair of probability 0 came out."""
    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    dv = None if dv_ids is None else DraftVocab(drafter.lm_head_weight, dv_ids)
    prompt, first = ([1, 2], 2) if tree else ([1], 1)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=2, max_batch_size=32, block_size=4,
                              seed=1234, **({"spec_tree": "2x2"} if tree else {}), **cfg),
                 model=target, draft_model=drafter, draft_vocab=dv)
    reqs = eng.run([eng.add_request(prompt, params) for _ in range(N)])
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[first - 1], r.output_ids[first]] += 1
    assert eng.stats.num_drafts > 0 and (not tree or eng.stats.tree_rounds > 0)
    try:
        return chi2_pvalue(counts, joint(target, prompt, first))
    except AssertionError:  # a zero-probability pair
        return 0.0


def _pvalue(params, words=None, dv_ids=None, tree=False, **cfg):
    return engine_pvalue(params, lambda target, prompt, first: _joint(target, params, words or [], prompt, first),
                         dv_ids, tree, **cfg)


def _likely_words():
    """The target's likeliest first token after [1] (banned alone) and, after the second likeliest, its likeliest
    other token (banned as a two-token word): the drafter proposes both often, so a ban missed at a position shows."""
    target = random_llama(V, seed=0)
    with torch.no_grad():
        first = target.compute_logits(target(torch.tensor([[1]])))[0, -1].topk(2).indices.tolist()
        nxt = target.compute_logits(target(torch.tensor([[1, first[1]]])))[0, -1]
        nxt[first[0]] = float("-inf")  # banned alone already
        after = int(nxt.argmax())
    return [[first[0]], [first[1], after]]


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_engine_joint_law_with_bad_words_and_allowed_tokens(backend):
    words = _likely_words()
    assert _pvalue(SamplingParams(temperature=1.0, max_tokens=3, bad_words=words), words,
                   kv_cache_backend=backend) > 0.001
    allowed = SamplingParams(temperature=0.7, top_k=5, max_tokens=3, allowed_token_ids=[0, 2, 4, 5, 7],
                             bad_words=words[1:])
    assert _pvalue(allowed, words[1:], kv_cache_backend=backend) > 0.001
    if backend == "paged":  # a draft vocabulary (with the prompt's token 1) that holds none of the allowed tokens
        outside = SamplingParams(temperature=1.0, max_tokens=3, allowed_token_ids=[4, 5, 7])
        assert _pvalue(outside, dv_ids=[0, 2, 3, 6]) > 0.001


def test_tree_rounds_joint_law_with_bad_words():
    words = _likely_words()
    assert _pvalue(SamplingParams(temperature=1.0, max_tokens=4, bad_words=words), words, tree=True) > 0.001


def test_a_verify_without_the_ban_is_caught(monkeypatch):
    monkeypatch.setattr(round_module, "ban_bad_words_", lambda *a, **k: None)
    words = _likely_words()
    assert _pvalue(SamplingParams(temperature=1.0, max_tokens=3, bad_words=words), words) < 1e-4
