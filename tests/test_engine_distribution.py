"""Losslessness through the batched engine: many concurrent sampled requests, drafted from their very first
token (one-token prompt, so there is no target prefill to sample from), reproduce the target's exact joint law of
the first two tokens. The exact law and the chi-square check are those of test_spec_distribution.py; the same
run with the residual adjustment switched off (lossy) fails, so the check has the power to catch it here too.
"""

import functools
import importlib

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.sampling import SamplingParams
from infer.spec.draft_vocab import DraftVocab
from infer.testing import random_llama

from test_spec_distribution import N, V, chi2_pvalue, exact_joint

PROMPT = [1]


PARAMS = [SamplingParams(temperature=1.0, max_tokens=3), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=3)]


def _pvalue(params, monkeypatch, draft_vocab_ids=None):
    import test_spec_distribution as tsd

    monkeypatch.setattr(tsd, "PROMPT", PROMPT)
    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    dv = None if draft_vocab_ids is None else DraftVocab(drafter.lm_head_weight, draft_vocab_ids)
    eng = Engine(EngineConfig(model="target", draft_model="drafter", spec_length=2, max_batch_size=32,
                              block_size=4, seed=1234), model=target, draft_model=drafter, draft_vocab=dv)
    reqs = [eng.add_request(PROMPT, params) for _ in range(N)]
    eng.run(reqs)
    counts = torch.zeros(V, V)
    for r in reqs:
        counts[r.output_ids[0], r.output_ids[1]] += 1
    assert 0.2 < eng.stats.acceptance_rate < 0.9  # drafts are judged, and rejected often
    return chi2_pvalue(counts, exact_joint(target, params))


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
def test_engine_joint_distribution_equals_target(params, monkeypatch):
    assert _pvalue(params, monkeypatch) > 0.001


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
def test_lossy_engine_is_detected(params, monkeypatch):
    runner = importlib.import_module("infer.engine.speculative_runner")
    verify = importlib.import_module("infer.spec.verify").verify
    monkeypatch.setattr(runner, "verify", functools.partial(verify, skip_sample_adjustment=True))
    assert _pvalue(params, monkeypatch) < 1e-4


SUBSET = [0, 2, 3, 6]  # the engine's draft vocabulary is static: no prompt tokens are added


@pytest.mark.parametrize("params", PARAMS, ids=["T=1", "T=0.7+top-k+top-p"])
def test_engine_joint_distribution_with_a_draft_vocabulary(params, monkeypatch):
    """Half the tokens have q = 0: drafts come from the rest, the residual supplies the others; same law."""
    assert _pvalue(params, monkeypatch, SUBSET) > 0.001


def test_lossy_engine_with_a_draft_vocabulary_is_detected(monkeypatch):
    runner = importlib.import_module("infer.engine.speculative_runner")
    verify = importlib.import_module("infer.spec.verify").verify
    monkeypatch.setattr(runner, "verify", functools.partial(verify, skip_sample_adjustment=True))
    assert _pvalue(PARAMS[0], monkeypatch, SUBSET) < 1e-4
