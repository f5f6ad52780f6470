"""Logits processors (vLLM's ``SamplingParams.logits_processors``; infer.logits_processors): both of vLLM's forms,
applied at every verified position with the drafts before it (chain and tree), greedy parity of plain, speculating
and token-by-token decoding, the exact joint law of two tokens under sampling through the batched engine on both KV
backends and in tree rounds, a verify that calls them without the drafts caught by the same test, and the
parameter's refusals."""

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.generate import autoregressive_generate
from infer.logits_processors import apply_logits_processors_
from infer.request import Request
from infer.sampling import SamplingParams
from infer.spec_decode import round as round_module
from infer.testing import random_llama
from infer.token_bans import chain_drafted

from test_spec_distribution import V, _next
from test_token_bans import engine_pvalue, joint_of


def no_repeat(output_ids, logits):
    """The last output token cannot come again at once (a new tensor)."""
    if output_ids:
        logits = logits.clone()
        logits[output_ids[-1]] = float("-inf")
    return logits


def lift(prompt_ids, output_ids, logits):
    """vLLM's three-argument form, in place: the token picked by the position's length is lifted by 2."""
    logits[(len(prompt_ids) + len(output_ids) * 3) % V] += 2.0
    return logits


PROCESSORS = [no_repeat, lift]


def test_each_position_sees_the_output_and_the_drafts_before_it():
    """A verify's [B, T, V]: position t of a row is processed after the output plus its first t drafts; pads are
    left alone, and a request without processors is untouched."""
    seen = []

    def record(prompt_ids, output_ids, logits):
        seen.append((list(prompt_ids), list(output_ids)))
        return logits + 1.0

    a = Request([1, 2], SamplingParams(logits_processors=[record]))
    a.output_ids = [5]
    b = Request([3], SamplingParams())
    logits = torch.zeros(2, 4, V)
    apply_logits_processors_(logits, [a, b], chain_drafted([[6, 7], [4]]))
    assert seen == [([1, 2], [5]), ([1, 2], [5, 6]), ([1, 2], [5, 6, 7])]
    assert logits[0, :3].eq(1.0).all() and logits[0, 3].eq(0.0).all() and logits[1].eq(0.0).all()


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_greedy_plain_speculating_and_token_by_token_agree(backend):
    """Greedy with the processors: plain decoding, speculating chains (paged: trees too) and the token-by-token
    loop give the same tokens, other than without them, and never a token twice in a row."""
    target, drafter = random_llama(V, seed=0), random_llama(V, seed=1, noise_from=0, noise=0.3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logits_processors=PROCESSORS)
    prompt = [1, 2, 3]
    cfg = dict(block_size=4, kv_cache_backend=backend)
    plain = Engine(EngineConfig(model="t", **cfg), model=target)
    want = plain.run([plain.add_request(prompt, params)])[0].output_ids
    free = plain.run([plain.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))])
    assert want != free[0].output_ids and all(x != y for x, y in zip(want, want[1:]))
    assert autoregressive_generate(target, prompt, params, eos_token_ids=[]).output_ids == want
    shapes = [None] + (["3x2:6"] if backend == "paged" else [])
    for tree in shapes:
        spec = Engine(EngineConfig(model="t", draft_model="d", spec_length=3, spec_tree=tree, **cfg), model=target,
                      draft_model=drafter)
        assert spec.run([spec.add_request(prompt, params)])[0].output_ids == want, tree
        assert spec.stats.num_drafts > 0 and (tree is None or spec.stats.tree_rounds > 0)


def _joint(target, params, prompt, first):
    """The exact law under the pipeline, each position's logits processed after the output before it."""
    n = len(prompt)

    def nxt(seq):
        with torch.no_grad():
            logits = target.compute_logits(target(torch.tensor([seq])))[0, -1]
        for fn in params.logits_processors:
            logits = fn(seq[n:], logits) if fn is no_repeat else fn(seq[:n], seq[n:], logits)
        bare = SamplingParams(temperature=params.temperature, top_k=params.top_k)
        return _next(_Fixed(logits), [seq], bare, n)[0]

    return joint_of(nxt, prompt, first)


class _Fixed:
    """A stand-in model whose logits are given (``_next`` reads ``config.vocab_size`` and calls it)."""

    def __init__(self, logits):
        self.logits, self.config = logits, type("C", (), {"vocab_size": V})

    def __call__(self, x):
        return x

    def compute_logits(self, _):
        return self.logits[None, None].clone()


def _pvalue(params, tree=False, **cfg):
    """The chi-square p-value of N sampled requests through one round (test_token_bans.engine_pvalue) against the
    exact processed law."""
    return engine_pvalue(params, lambda target, prompt, first: _joint(target, params, prompt, first), tree=tree, **cfg)


SAMPLED = SamplingParams(temperature=1.0, max_tokens=3, logits_processors=PROCESSORS)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_engine_joint_law_with_processors(backend):
    assert _pvalue(SAMPLED, kv_cache_backend=backend) > 0.001
    assert _pvalue(SamplingParams(temperature=0.7, top_k=5, max_tokens=3, logits_processors=PROCESSORS),
                   kv_cache_backend=backend) > 0.001


def test_tree_rounds_joint_law_with_processors():
    assert _pvalue(SamplingParams(temperature=1.0, max_tokens=4, logits_processors=PROCESSORS), tree=True) > 0.001


def test_a_verify_that_calls_them_without_the_drafts_is_caught(monkeypatch):
    def blind(logits, reqs, drafted=None):  # every position processed as if it followed the output alone
        apply_logits_processors_(logits, reqs, [[[] for _ in d] for d in drafted])

    monkeypatch.setattr(round_module, "apply_logits_processors_", blind)
    assert _pvalue(SAMPLED) < 1e-4


def test_processors_that_are_not_functions_of_the_context_are_refused():
    for bad, says in ((no_repeat, "must be a list"), ([no_repeat, 3], r"logits_processors\[1\]"),
                      ([lambda logits: logits], r"logits_processors\[0\]")):
        with pytest.raises(ValueError, match=says):
            SamplingParams(logits_processors=bad)
    assert SamplingParams(logits_processors=[]).logits_processors is None
    eng = Engine(EngineConfig(model="t"), model=random_llama(V, seed=0))
    req = eng.add_request([1, 2], SamplingParams(max_tokens=2, logits_processors=[lambda out, logits: None]))
    with pytest.raises(TypeError, match="must return the position's logits"):
        eng.run([req])


def test_a_processor_that_fails_ends_the_call_and_leaves_the_engine_clean(gqa_dir):
    """What a processor raises mid-round ends LLM.generate with it, as does one that leaves no token to sample (a
    ValueError saying so); the call's requests are aborted on the way out, their KV freed, and the next call's
    tokens are a fresh engine's."""
    from infer import LLM

    def fails(output_ids, logits):
        if len(output_ids) >= 3:
            raise RuntimeError("processor gave up")
        return logits

    def nothing(output_ids, logits):
        return torch.full_like(logits, float("-inf"))

    llm = LLM(gqa_dir, draft_model=gqa_dir, spec_length=3, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["def fib(n):", "import os"]
    for fn, error, says in ((fails, RuntimeError, "gave up"), (nothing, ValueError, "nothing to sample")):
        with pytest.raises(error, match=says):
            llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=12, logits_processors=[fn]))
        assert not llm.engine.has_unfinished and llm.engine.free_kv_tokens() == llm.engine.initial_free_kv_tokens
    want = LLM(gqa_dir, draft_model=gqa_dir, spec_length=3, block_size=4).generate(prompts, greedy)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in want]
