"""End-to-end losslessness: speculative sampling reproduces the target's exact joint distribution.

Two different tiny random models over an 8-token vocabulary (the drafter resembles the target, alpha ~ 0.5, so
drafts are accepted about half the time and rejections are frequent). The exact law of the first two generated
tokens is computed from the target's logits through the same sampling pipeline; N speculative generations
(K = 2, drafting from the very first token) are compared with it by a chi-square test. The same test run with
the lossy ``skip_sample_adjustment=True`` fails by a wide margin, so it can tell a lossy variant apart.
"""

import copy

import pytest
import torch
from scipy.stats import chisquare

from infer.sampling import SamplingBatch, SamplingParams, logits_to_probs
from infer.spec import speculative_generate
from infer.spec.draft_vocab import DraftVocab
from infer.testing import random_llama

V = 8
PROMPT = [1, 2, 3]
N = 2500


@pytest.fixture(scope="module")
def models():
    return random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)


def exact_joint(target, params) -> torch.Tensor:
    """P(x1, x2 | prompt) = p(x1 | prompt) p(x2 | prompt, x1) under the sampling pipeline. [V, V]"""
    batch = SamplingBatch.from_params([params], V, "cpu")
    with torch.no_grad():
        p1 = logits_to_probs(target.compute_logits(target(torch.tensor([PROMPT])))[:, -1], batch)[0]
        seqs = torch.tensor([PROMPT + [x] for x in range(V)])
        p2 = logits_to_probs(target.compute_logits(target(seqs))[:, -1], batch.expand(V))
    return p1[:, None] * p2


def sampled_joint(target, drafter, params, skip=False, **kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V)
    for _ in range(N):
        out, _ = speculative_generate(target, drafter, PROMPT, params, gamma=2, eos_token_ids=[], generator=g,
                                      first_target=False, skip_sample_adjustment=skip, **kw)
        x1, x2 = out.output_ids[:2]
        counts[x1, x2] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    assert counts[probs == 0].sum() == 0, "a zero-probability pair was generated"
    exp = probs.flatten() * N
    obs = counts.flatten()
    big = exp >= 5  # pool sparse cells so the chi-square approximation holds
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    return chisquare(o[keep].numpy(), e[keep].numpy() * o[keep].sum().item() / e[keep].sum().item()).pvalue


PARAMS = {
    "temperature 1": SamplingParams(temperature=1.0, max_tokens=3),
    "temperature 0.7, top-k 5, top-p 0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=3),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_joint_distribution_equals_target(models, name):
    target, drafter = models
    params = PARAMS[name]
    assert chi2_pvalue(sampled_joint(target, drafter, params), exact_joint(target, params)) > 0.001


def test_joint_distribution_with_a_bfloat16_drafter(models):
    """Drafter and target in different dtypes (the benchmark's bf16 + fp32 pairing): q and p are both float32
    probabilities from the one pipeline, so the law stays the target's."""
    target, drafter = models
    drafter_bf16 = copy.deepcopy(drafter).to(torch.bfloat16)
    params = PARAMS["temperature 1"]
    assert chi2_pvalue(sampled_joint(target, drafter_bf16, params), exact_joint(target, params)) > 0.001


@pytest.mark.parametrize("name", list(PARAMS))
def test_lossy_variant_is_detected(models, name):
    """The same check flags skip_sample_adjustment=True: the test has the power to catch a lossy sampler."""
    target, drafter = models
    params = PARAMS[name]
    assert chi2_pvalue(sampled_joint(target, drafter, params, skip=True), exact_joint(target, params)) < 1e-4


def test_joint_distribution_with_a_draft_vocabulary(models):
    """The drafter scores only {0, 7} plus the prompt's {1, 2, 3}: q(x) = 0 for x in {4, 5, 6}, which reach the
    output only through the residual norm(max(0, p - q)) at a rejection. The law is still the target's."""
    target, drafter = models
    params = PARAMS["temperature 0.7, top-k 5, top-p 0.9"]
    dv = DraftVocab(drafter.lm_head_weight, [0, 7])
    counts = sampled_joint(target, drafter, params, draft_vocab=dv)
    assert counts[4].sum() > 0 and counts[:, 4].sum() > 0  # a token the drafter cannot propose still appears
    assert chi2_pvalue(counts, exact_joint(target, params)) > 0.001
