"""End-to-end losslessness: speculative sampling reproduces the target's exact joint distribution.

Two different tiny random models over an 8-token vocabulary (the drafter resembles the target, alpha ~ 0.5, so
drafts are accepted about half the time and rejections are frequent). The library call runs the engine's round
for one request: the first token comes from the target's prefill, the next two from one speculative round (K = 2).
Their exact law, P(x2, x3) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2), is computed from the target's logits through
the same sampling pipeline, and N speculative generations are compared with it by a chi-square test. The same test
with a lossy acceptance rule fails by a wide margin, so it can tell a lossy variant apart.
"""

import pytest
import torch
from scipy.stats import chisquare

from infer.sampling import SamplingBatch, SamplingParams, logits_to_probs, penalty_context
from infer.speculative import speculative_generate
from infer.testing import random_llama

V = 8
PROMPT = [1, 2, 3]
N = 1000


@pytest.fixture(scope="module")
def models():
    return random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)


def _next(target, seqs, params, prompt_len: int | None = None, banned=()) -> torch.Tensor:
    """p(. | seq) for each sequence, through the sampling pipeline (the penalties see the sequence: its first
    ``prompt_len`` tokens as the prompt, the rest as output; ``banned`` tokens masked out first, as min_tokens masks
    a request's stops). [len(seqs), V]"""
    V = target.config.vocab_size
    batch = SamplingBatch.from_params([params], V, "cpu").expand(len(seqs))
    seen = penalty_context(seqs, V, "cpu", [len(s) if prompt_len is None else prompt_len for s in seqs]) \
        if batch.use_penalty else None
    with torch.no_grad():
        logits = target.compute_logits(target(torch.tensor(seqs)))[:, -1]
        logits[:, list(banned)] = float("-inf")
        return logits_to_probs(logits, batch, seen)


def exact_joint(target, params, first: int = 2, prompt=None, banned=()) -> torch.Tensor:
    """P(x_first, x_first+1 | prompt) [V, V]: first=1 the first two generated tokens, first=2 the second and third
    (the first summed out); ``banned`` tokens masked out at every one of those positions."""
    prompt = PROMPT if prompt is None else prompt
    V = target.config.vocab_size
    n = len(prompt)
    if first == 1:
        return _next(target, [prompt], params, n, banned)[0][:, None] * _next(
            target, [prompt + [x] for x in range(V)], params, n, banned)
    p1 = _next(target, [prompt], params, n, banned)[0]  # [V]
    p2 = _next(target, [prompt + [a] for a in range(V)], params, n, banned)  # [V(x1), V(x2)]
    p3 = _next(target, [prompt + [a, b] for a in range(V) for b in range(V)], params, n, banned).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)


def sampled_joint(target, drafter, params, **kw) -> torch.Tensor:
    """Counts of (x2, x3) over N library calls; x2 and x3 come from one speculative round."""
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V)
    prompt = kw.pop("prompt", PROMPT)
    for _ in range(N):
        out, _ = speculative_generate(target, drafter, prompt, params, spec_length=2, eos_token_ids=[], generator=g,
                                      **kw)
        x2, x3 = out.output_ids[1:3]
        counts[x2, x3] += 1
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


PARAMS = {  # max_tokens 4: the round after the first token has room for K = 2 drafts
    "temperature 1": SamplingParams(temperature=1.0, max_tokens=4),
    "temperature 0.7, top-k 5, top-p 0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=4),
    # every penalty at once and a logit bias, strong enough to reshape p at each judged position (x3's law sees x1
    # and x2)
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0,
                                frequency_penalty=0.7, logit_bias={2: 1.0, 5: -2.0}, max_tokens=4),
}


def test_speculative_joint_distribution_equals_target(models):
    target, drafter = models
    params = PARAMS["temperature 0.7, top-k 5, top-p 0.9"]
    assert chi2_pvalue(sampled_joint(target, drafter, params), exact_joint(target, params)) > 0.001


def test_penalties_keep_the_joint_distribution(models):
    """Repetition, presence and frequency penalties and a logit bias: each verified position's p sees the context
    grown by the drafts before it (the drafts' q likewise), so the round still reproduces the target's penalised
    law; the exact law without them is far from it (the check tells the two apart)."""
    target, drafter = models
    params = PARAMS["penalties"]
    counts = sampled_joint(target, drafter, params)
    assert chi2_pvalue(counts, exact_joint(target, params)) > 0.001
    assert chi2_pvalue(counts, exact_joint(target, PARAMS["temperature 1"])) < 1e-4


def test_lossy_variant_is_detected(models):
    """The same check flags the lossy skip-adjustment rule: the test has the power to catch a lossy sampler. (The
    engine's batched tests, tests/test_engine_distribution.py, cover the other proposers, rules and settings.)"""
    target, drafter = models
    params = PARAMS["temperature 1"]
    counts = sampled_joint(target, drafter, params, acceptance="skip_adjustment")
    assert chi2_pvalue(counts, exact_joint(target, params)) < 1e-4
