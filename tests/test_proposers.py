"""Proposers and the K policy: prompt lookup finds what it should, every proposer and K schedule keeps greedy
parity on both KV backends, the goodput policy drafts when it pays and falls to K = 0 when it does not."""

import pytest

from infer import LLM, SamplingParams
from infer.engine import Engine, EngineConfig
from infer.model import load_model
from infer.request import Request
from infer.spec_decode import speculative_generate
from infer.spec_decode.ngram import NgramProposer
from infer.spec_decode.spec_length import CostModel, GoodputSpecLength, expected_tokens
from infer.testing import make_tiny_llama


def _req(ids):
    return Request(ids, SamplingParams(max_tokens=50))


def test_prompt_lookup_finds_the_latest_longest_match():
    ng = NgramProposer(min_n=1, max_n=3)
    r = _req([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 5, 6])
    # suffix (5, 6): latest earlier occurrence at index 7 -> followed by 7, 3, 5, 6
    assert ng.lookup(r, 3) == [7, 3, 5]
    r.output_ids += [7]  # suffix (5, 6, 7): the 3-gram wins, latest earlier occurrence at index 7
    assert ng.lookup(r, 4) == [3, 5, 6, 7]
    assert ng.lookup(_req([1, 2, 3, 4]), 3) == []  # nothing repeats: no drafts
    assert NgramProposer(2, 3).lookup(_req([4, 1, 4]), 2) == []  # a 1-gram match is below min_n
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


@pytest.fixture(scope="module")
def pair(gqa_dir, tmp_path_factory):
    d = make_tiny_llama(tmp_path_factory.mktemp("drafter"), "gqa", seed=1, num_hidden_layers=1)
    return load_model(gqa_dir), load_model(d), d


REPEATING = [0, 11, 12, 13, 14, 15, 11, 12, 13]  # a prompt with a repeat: prompt lookup has something to copy


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("proposer,spec_length", [("ngram", 3), ("ngram", "auto"), ("hybrid", 4),
                                                  ("hybrid", "auto"), ("draft", "auto")])
def test_greedy_parity_every_proposer_and_k(pair, backend, proposer, spec_length):
    target, drafter, _ = pair
    params = SamplingParams(temperature=0, max_tokens=30)
    for prompt in (REPEATING, [0, 9], [0, 42, 17, 250, 3, 8, 99]):
        want = speculative_generate(target, None, prompt, params, spec_length=1, proposer="ngram",
                                    prompt_lookup_min=99, prompt_lookup_max=99,
                                    kv_cache_backend=backend)[0].output_ids  # never matches: plain decoding
        out, _ = speculative_generate(target, None if proposer == "ngram" else drafter, prompt, params,
                                      spec_length=spec_length, proposer=proposer, prompt_lookup_min=1,
                                      eos_token_ids=[], kv_cache_backend=backend)
        assert out.output_ids == want


def test_self_repeating_output_is_drafted_by_prompt_lookup(gqa_dir):
    """A random tiny model soon loops; prompt lookup then drafts the loop and it is accepted (and stays exact)."""
    params = SamplingParams(temperature=0, max_tokens=60)
    plain = LLM(gqa_dir).generate([[0, 5, 6]], params)[0]
    ng = LLM(gqa_dir, proposer="ngram", spec_length=4, prompt_lookup_min=1).generate([[0, 5, 6]], params)[0]
    assert ng.token_ids == plain.token_ids
    assert ng.num_accepted_tokens > 0 and ng.mean_accepted_length > 1.0


def test_goodput_policy_drafts_when_it_pays_and_not_when_it_does_not():
    reqs = [_req([1, 2]) for _ in range(4)]
    cheap = CostModel.from_points(4, 6, {(1, 1): 1.0, (1, 7): 1.1, (4, 1): 1.1, (4, 7): 1.3}, {1: 0.05, 4: 0.06})
    policy = GoodputSpecLength(6, cheap)
    ks = policy.choose(reqs, [6] * 4)
    assert all(k >= 3 for k in ks)  # a = 0.6 prior, cheap drafts and verifies: draft long
    # the cost of verifying k+1 tokens per row grows with the tokens (a big batch is no longer weight-bound)
    dear = CostModel.from_points(4, 6, {(1, 1): 1.0, (1, 7): 1.2, (4, 1): 1.0, (4, 7): 7.0}, {1: 0.3, 4: 0.4})
    busy = GoodputSpecLength(6, dear)
    assert busy.choose(reqs, [6] * 4) == [0, 0, 0, 0]
    # per request: a row whose drafts keep failing stops drafting while a good one goes on
    policy = GoodputSpecLength(6, cheap)
    for _ in range(10):
        policy.observe(reqs[0], 4, 4)
        policy.observe(reqs[1], 4, 0)
    a_good, a_bad = policy.alpha(reqs[0]), policy.alpha(reqs[1])
    assert a_good > 0.8 and a_bad < 0.3
    ks = GoodputSpecLength(6, CostModel.from_points(2, 6, {(1, 1): 1.0, (1, 7): 1.1, (2, 1): 1.0, (2, 7): 1.2},
                                                      {1: 0.2, 2: 0.4}))  # drafting a row costs
    ks.state = policy.state
    ks.global_accepted, ks.global_judged = policy.global_accepted, policy.global_judged
    choice = ks.choose(reqs[:2], [6, 6])
    assert choice[0] > 0 and choice[1] == 0
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_cost_model_interpolates_and_refreshes():
    c = CostModel.from_points(8, 4, {(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 6.0}, {1: 0.1, 4: 0.2})
    assert c.verify_cost(1, 3) == pytest.approx(1.5) and c.verify_cost(2, 1) == pytest.approx(4 / 3)
    assert c.verify_cost(8, 1) == pytest.approx(10 / 3)  # extrapolated from the last segment
    c.refresh_verify(1, 1, 100.0)  # an outlier moves a cell by at most OUTLIER x its value (times the EMA weight)
    assert c.verify_cost(1, 1) == pytest.approx(1.0 + c.ema * (c.OUTLIER * 1.0 - 1.0))


def test_auto_k_on_measured_costs_in_a_batch_stays_exact(gqa_dir):
    """The engine profiles its own costs at start-up (self-drafting: a draft step costs a decode step) and auto K
    decides per round from them; whatever it decides, the batch's output is the plain one."""
    prompts = [[0, i, i + 1] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = LLM(gqa_dir, max_batch_size=8).generate(prompts, params)
    eng = Engine(EngineConfig(model=gqa_dir, draft_model=gqa_dir, max_batch_size=8))
    policy = eng.decoder.spec_length
    assert isinstance(policy, GoodputSpecLength)
    got = eng.run([eng.add_request(p, params) for p in prompts])
    assert [r.output_ids for r in got] == [o.token_ids for o in plain]
    ratio = policy.costs.verify_cost(8, 9) / policy.costs.verify_cost(8, 1)
    assert ratio > 1.0  # what the profile measured: 9 tokens per row cost more than 1
