"""Losslessness through the batched engine: many concurrent sampled requests reproduce the target's exact joint
law of two consecutive tokens. With a one-token prompt there is no prefill to sample from, so the first two tokens
come from one round; the prompt-lookup cases use a prompt with repeats and judge tokens 2 and 3 (token 1 comes from
the prefill). Covered: draft model (float32 and a bfloat16 drafter, draft vocabulary), n-gram and hybrid proposers
(deterministic drafts), K chosen by the goodput policy, both KV backends. The exact law and the chi-square check
are those of test_spec_distribution.py; every LOSSY acceptance rule fails the same check, so it has the power to
catch a lossy variant and what it protects is the lossless default.
"""

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.sampling import SamplingParams
from infer.proposers.draft_vocab import DraftVocab
from infer.spec_decode.cost_model import CostModel
from infer.spec_decode.spec_length import GoodputSpecLength
from infer.testing import random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint

PROMPT = [1]


PARAMS = [SamplingParams(temperature=1.0, max_tokens=3), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=3)]


NGRAM_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # every x1 in {1, 2, 3} finds a 1-gram match, some a 2-gram one


def _pvalue(params, draft_vocab_ids=None, prompt=PROMPT, drafter_dtype=None, costs=None, banned=(), **cfg):
    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    if drafter_dtype is not None:
        drafter = drafter.to(drafter_dtype)
    dv = None if draft_vocab_ids is None else DraftVocab(drafter.lm_head_weight, draft_vocab_ids)
    cfg = {"draft_model": "drafter", "spec_length": 2, "max_batch_size": 32, "block_size": 4, "seed": 1234, **cfg}
    if cfg.get("proposer") == "ngram":
        cfg["draft_model"], drafter = None, None
    eng = Engine(EngineConfig(model="target", **cfg), model=target, draft_model=drafter, draft_vocab=dv)
    if costs is not None:  # the goodput policy over a given (frozen) cost model
        eng.decoder.spec_length = GoodputSpecLength(cfg["spec_length_max"], costs)
    reqs = [eng.add_request(prompt, params) for _ in range(N)]
    eng.run(reqs)
    first = 1 if len(prompt) == 1 else 2  # the two tokens one round produced
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[first - 1], r.output_ids[first]] += 1
    assert 0.2 < eng.stats.acceptance_rate < 0.9  # drafts are judged, and rejected often
    return chi2_pvalue(counts, exact_joint(target, params, first=first, prompt=prompt, banned=banned))


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
def test_engine_joint_distribution_equals_target(params):
    assert _pvalue(params) > 0.001


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
def test_lossy_engine_is_detected(params):
    assert _pvalue(params, acceptance="skip_adjustment") < 1e-4


PENALISED = SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.7,
                           logit_bias={2: 1.0, 5: -2.0}, max_tokens=3)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_engine_joint_distribution_with_penalties(backend):
    """Repetition, presence and frequency penalties and a logit bias in a batched round: each position's p (and each
    draft's q) sees its row's context plus the drafts before it; the law is the target's penalised one. With a draft
    vocabulary too: the drafter's q over its columns takes the bias there."""
    assert _pvalue(PENALISED, kv_cache_backend=backend) > 0.001
    if backend == "paged":
        assert _pvalue(PENALISED, SUBSET) > 0.001


SUBSET = [0, 2, 3, 6]  # plus the prompt's token 1


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
def test_engine_joint_distribution_with_a_draft_vocabulary(params):
    """Half the tokens have q = 0: drafts come from the rest, the residual supplies the others; same law."""
    assert _pvalue(params, SUBSET) > 0.001


def test_lossy_engine_with_a_draft_vocabulary_is_detected():
    assert _pvalue(PARAMS[0], SUBSET, acceptance="skip_adjustment") < 1e-4


LATER = SamplingParams(temperature=1.0, max_tokens=4)  # room for K = 2 in the round after the prefill's token


@pytest.mark.parametrize("proposer", ["ngram", "hybrid"])
@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_prompt_lookup_joint_distribution(proposer, backend):
    """Deterministic drafts (q = None; in the hybrid, one-hot rows beside the model's q rows)."""
    assert _pvalue(LATER, prompt=NGRAM_PROMPT, proposer=proposer, prompt_lookup_min=1,
                   kv_cache_backend=backend) > 0.001


def test_auto_k_and_a_bfloat16_drafter():
    """K from the goodput policy (any K schedule is lossless) with a drafter in another dtype than the target. The
    tiny pair's measured costs make drafting as dear as verifying, so the policy would rightly never draft; a frozen
    cost model of a cheap drafter (a tenth of a verify) makes it choose K per request, round by round."""
    costs = CostModel.from_points(32, 4, {(1, 1): 1.0, (1, 5): 1.1, (32, 1): 1.5, (32, 5): 2.0}, {1: 0.1, 32: 0.15})
    costs.ema = 0.0
    assert _pvalue(PARAMS[1], spec_length="auto", spec_length_max=4, drafter_dtype=torch.bfloat16,
                   kv_cache_backend="contiguous", costs=costs) > 0.001


def _cutting(monkeypatch, sampled_too: bool) -> list:
    """Auto K at K = 2 every round over a cost model that prices verify tokens dear, its cut (GoodputSpecLength.cut)
    spied on: [(drafts, verified)] a round. ``sampled_too``: the lossy variant, drawn rows cut by q(t) as well."""
    monkeypatch.setattr(GoodputSpecLength, "choose", lambda self, reqs, caps: [min(2, c) for c in caps])
    seen, cut, init = [], GoodputSpecLength.cut, GoodputSpecLength.__init__

    def lossy(self, *args):
        init(self, *args)
        self.cut_drawn = sampled_too

    def spy(self, *args):
        out = cut(self, *args)
        seen.append((sum(args[1]), sum(out)))
        return out

    monkeypatch.setattr(GoodputSpecLength, "cut", spy)
    monkeypatch.setattr(GoodputSpecLength, "__init__", lossy)
    return seen


CUT_COSTS = dict(spec_length="auto", spec_length_max=2)


def _cut_costs() -> CostModel:
    costs = CostModel.from_points(32, 2, {(1, 1): 1.0, (1, 3): 1.5, (32, 1): 1.5, (32, 3): 3.0}, {1: 0.05, 32: 0.1})
    costs.ema = 0.0
    return costs


def test_drafts_cut_by_their_own_confidence_break_the_law_and_drawn_rows_are_not_cut(monkeypatch):
    """Auto K cuts greedy rows' drafts by the drafter's confidence in each (GoodputSpecLength.cut). Applied to drawn
    rows, that rule is lossy: a draft verified only when q(t) is high follows q restricted to the confident tokens,
    not the q it is judged by. This test has the power to see it, and the engine does not cut drawn rows."""
    seen = _cutting(monkeypatch, sampled_too=True)
    assert _pvalue(PARAMS[0], costs=_cut_costs(), **CUT_COSTS) < 1e-4
    drafted, verified = map(sum, zip(*seen))
    assert 0.2 * drafted < verified < 0.8 * drafted  # the variant did cut
    seen.clear()
    monkeypatch.undo()
    seen = _cutting(monkeypatch, sampled_too=False)
    assert _pvalue(PARAMS[0], costs=_cut_costs(), **CUT_COSTS) > 0.001
    assert all(d == v for d, v in seen)  # drawn rows: every draft verified (a batch without greedy rows: no call)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_greedy_rows_cut_by_confidence_decode_as_the_target(monkeypatch, backend):
    """The cut where it acts (greedy rows): whatever prefix of its drafts a row verifies, its tokens are the target's
    argmax chain. 32 greedy requests decoding 12 tokens, drafts cut often, against plain decoding."""
    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [[1 + i % (V - 1), (3 * i) % V] for i in range(32)]
    plain = Engine(EngineConfig(model="target", max_batch_size=32, kv_cache_backend=backend), model=target)
    want = [r.output_ids for r in plain.run([plain.add_request(p, params) for p in prompts])]
    seen = _cutting(monkeypatch, sampled_too=False)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", max_batch_size=32, block_size=4,
                              kv_cache_backend=backend, **CUT_COSTS), model=target, draft_model=drafter)
    eng.decoder.spec_length = GoodputSpecLength(2, _cut_costs())
    got = [r.output_ids for r in eng.run([eng.add_request(p, params) for p in prompts])]
    assert got == want
    drafted, verified = map(sum, zip(*seen))
    assert 0 < verified < drafted


def test_a_round_whose_drafts_are_all_cut_prices_its_drafting_as_drafting(monkeypatch):
    """Every draft cut: the round decodes plainly, and its drafting is a draft round's cost (``drafted``), not the
    plain step's overhead (``round_overhead``), which auto K adds to a plain step's price. Counted as overhead, a lone
    SmolLM2 row's plain steps were priced ~0.6 ms dear (docs/benchmarks.md, a fourth session on the Xeon)."""
    import time as _time

    from infer.proposers.draft_model import DraftModelProposer

    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    monkeypatch.setattr(GoodputSpecLength, "choose", lambda self, reqs, caps: [min(2, c) for c in caps])
    monkeypatch.setattr(GoodputSpecLength, "cut", lambda self, reqs, nd, *a: [0] * len(nd))
    propose = DraftModelProposer.propose
    monkeypatch.setattr(DraftModelProposer, "propose", lambda self, batch: _time.sleep(0.03) or propose(self, batch))
    overheads, drafted = [], []
    over, draft = GoodputSpecLength.round_overhead, GoodputSpecLength.drafted
    monkeypatch.setattr(GoodputSpecLength, "round_overhead",
                        lambda self, B, spec, s: overheads.append((spec, s)) or over(self, B, spec, s))
    monkeypatch.setattr(GoodputSpecLength, "drafted", lambda self, *a: drafted.append(a) or draft(self, *a))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = Engine(EngineConfig(model="target", max_batch_size=1), model=target)
    want = plain.run([plain.add_request([1, 2], params)])[0].output_ids
    eng = Engine(EngineConfig(model="target", draft_model="drafter", max_batch_size=1, block_size=4, **CUT_COSTS),
                 model=target, draft_model=drafter)
    eng.decoder.spec_length = GoodputSpecLength(2, _cut_costs())
    assert eng.run([eng.add_request([1, 2], params)])[0].output_ids == want
    plain_steps = [s for spec, s in overheads if not spec]
    assert len(plain_steps) >= 5 and len(drafted) >= 5  # every round drafted, was cut whole, and stepped plainly
    assert max(plain_steps) < 0.03  # the 30 ms of drafting a round are not the plain step's


@pytest.mark.parametrize("acceptance", ["typical", "lenient"])
def test_lossy_acceptance_rules_fail_the_test(acceptance):
    """The opt-in lossy rules accept more drafts (what they buy) and fail the chi-square test (what it costs)."""
    assert _pvalue(PARAMS[0], acceptance=acceptance) < 1e-4


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_engine_joint_distribution_with_min_tokens(backend):
    """min_tokens (vLLM's): before the minimum a request's stop tokens are out of the target's law at every position a
    round verifies, and the drafter's drafts of one are rejected there. The stop here is the target's likeliest first
    token: one that slipped through is a zero-probability pair, and a mask on the wrong positions skews the law."""
    with torch.no_grad():
        target = random_llama(V, seed=0)
        stop = int(target.compute_logits(target(torch.tensor([PROMPT])))[0, -1].argmax())
    for params in (SamplingParams(temperature=1.0, max_tokens=3, min_tokens=2, stop_token_ids=[stop]),
                   SamplingParams(temperature=0.7, top_k=5, max_tokens=3, min_tokens=3, stop_token_ids=[stop])):
        assert _pvalue(params, kv_cache_backend=backend, banned=[stop]) > 0.001

