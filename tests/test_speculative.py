"""speculative_generate: greedy parity, stop conditions inside accepted runs, EGAG, theory, API, bad input."""

import pytest
import torch

from infer import LLM, SamplingParams
from infer.generate import autoregressive_generate
from infer.model import load_model
from infer.speculative import speculative_generate
from infer.spec_decode.adaptive import EntropyAdaptiveGamma
from infer.spec_decode.theory import expected_tokens_per_round, optimal_k, walltime_improvement
from infer.testing import make_tiny_llama, random_llama

PROMPTS = [[0, 5, 6, 7], [0, 9], [0, 100, 101, 102, 103], [0, 42, 17, 250, 3, 8, 99], [0, 200, 201]]


@pytest.fixture(scope="module")
def pair(gqa_dir, tmp_path_factory):
    """A target and a weak (independent random, 1-layer) drafter sharing the tokenizer."""
    d = make_tiny_llama(tmp_path_factory.mktemp("drafter"), "gqa", seed=1, num_hidden_layers=1)
    return load_model(gqa_dir), load_model(d), d


def assert_greedy_parity(target, drafter, prompts=PROMPTS, max_tokens=25, repetition_penalty=1.0,
                         presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, **kw):
    """Speculative output == the target's own greedy output for every prompt; returns [(Request, SpecStats)]."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            logit_bias=logit_bias)
    runs = []
    for prompt in prompts:
        expected = autoregressive_generate(target, prompt, params, []).output_ids
        out, stats = speculative_generate(target, drafter, prompt, params, eos_token_ids=[], **kw)
        assert out.output_ids == expected
        runs.append((out, stats))
    return runs


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_parity_weak_drafter(pair, k):
    target, drafter, _ = pair
    assert_greedy_parity(target, drafter, spec_length=k)


def test_greedy_parity_with_a_bfloat16_drafter(pair):
    """A float32 target with a drafter in another dtype: the output is still the target's greedy output."""
    target, _, d = pair
    for out, _ in assert_greedy_parity(target, load_model(d, dtype="bfloat16"), spec_length=3):
        assert out.num_draft_tokens > 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_parity_self_drafting_accepts_everything(pair, k):
    target, _, _ = pair
    for out, stats in assert_greedy_parity(target, target, spec_length=k):
        assert out.num_draft_tokens > 0 and out.num_accepted_tokens == out.num_draft_tokens
        assert stats.realized_acceptance == 1.0


def test_greedy_parity_with_repetition_penalty(pair):
    """The penalty context grows with each accepted draft; verification must see exactly that context."""
    target, drafter, _ = pair
    for d in (drafter, target):
        assert_greedy_parity(target, d, spec_length=4, repetition_penalty=1.5)


def test_greedy_parity_with_presence_and_frequency_penalties(pair):
    """OpenAI's penalties count the output, the accepted drafts included: a draft repeated within a round is
    counted twice at the position after it. Penalties that change the greedy text (checked) keep speculation's."""
    target, drafter, _ = pair
    plain = SamplingParams(temperature=0, max_tokens=25)
    penalised = SamplingParams(temperature=0, max_tokens=25, frequency_penalty=1.5, presence_penalty=0.5)
    assert any(autoregressive_generate(target, p, plain, []).output_ids !=
               autoregressive_generate(target, p, penalised, []).output_ids for p in PROMPTS)
    for d in (drafter, target):
        assert_greedy_parity(target, d, spec_length=4, frequency_penalty=1.5, presence_penalty=0.5)


def test_greedy_parity_with_a_logit_bias(pair):
    """A bias that moves the greedy text (checked): the verify's argmax is the biased logits', the drafts' too."""
    target, drafter, _ = pair
    bias = {t: 3.0 for t in range(0, 64, 3)}
    plain = SamplingParams(temperature=0, max_tokens=25)
    assert any(autoregressive_generate(target, p, plain, []).output_ids !=
               autoregressive_generate(target, p, SamplingParams(temperature=0, max_tokens=25, logit_bias=bias),
                                       []).output_ids for p in PROMPTS)
    for d in (drafter, target):
        assert_greedy_parity(target, d, spec_length=4, logit_bias=bias)


def _self_draft_until(target, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=25, **{k: v for k, v in kw.items() if k != "eos"})
    return speculative_generate(target, target, prompt, params, spec_length=8, eos_token_ids=kw.get("eos", []))[0]


def test_eos_inside_an_accepted_run_ends_exactly_there(pair):
    target, _, _ = pair
    full = autoregressive_generate(target, PROMPTS[0], SamplingParams(temperature=0, max_tokens=25), []).output_ids
    i = next(i for i in range(3, len(full)) if full[i] not in full[:i])  # mid-run with K=8, all accepted
    out = _self_draft_until(target, PROMPTS[0], eos=[full[i]])
    assert out.output_ids == full[: i + 1] and out.finish_reason == "stop"


def test_stop_token_inside_an_accepted_run(pair):
    target, _, _ = pair
    full = autoregressive_generate(target, PROMPTS[1], SamplingParams(temperature=0, max_tokens=25), []).output_ids
    i = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    out = _self_draft_until(target, PROMPTS[1], stop_token_ids=[full[i]])
    assert out.output_ids == full[: i + 1] and out.finish_reason == "stop"


def test_stop_string_inside_an_accepted_run(gqa_dir):
    llm = LLM(gqa_dir, draft_model=gqa_dir, spec_length=8)
    base = LLM(gqa_dir)
    full = base.generate(["def fib"], SamplingParams(temperature=0, max_tokens=30))[0]
    stop = full.text[6:9]
    a = base.generate(["def fib"], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    b = llm.generate(["def fib"], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "stop")


@pytest.mark.parametrize("k", [1, 3, 8])
def test_max_tokens_never_exceeded(pair, k):
    target, drafter, _ = pair
    for n in (1, 2, 3, 9):
        for d in (drafter, target):
            out, _ = speculative_generate(target, d, PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=n, seed=0),
                                          spec_length=k, eos_token_ids=[])
            assert len(out.output_ids) == n and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible(pair):
    target, drafter, _ = pair
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=5)
    a = speculative_generate(target, drafter, PROMPTS[0], params, spec_length=3, eos_token_ids=[])[0].output_ids
    b = speculative_generate(target, drafter, PROMPTS[0], params, spec_length=3, eos_token_ids=[])[0].output_ids
    assert a == b


def test_llm_speculative_outputs_and_metrics(gqa_dir, pair):
    _, _, drafter_dir = pair
    spec = LLM(gqa_dir, draft_model=drafter_dir, spec_length=4)
    plain = LLM(gqa_dir)
    prompts = ["def fib", "Hello world", "import os\n", "The cat", "x = 1"]
    params = SamplingParams(temperature=0, max_tokens=20)
    for a, b in zip(spec.generate(prompts, params), plain.generate(prompts, params)):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.num_draft_tokens > 0 and 0 <= a.num_accepted_tokens <= a.num_draft_tokens
        assert a.acceptance_rate == a.num_accepted_tokens / a.num_draft_tokens
        assert 1.0 <= a.mean_accepted_length <= 5.0
        assert sum(a.metrics["accepted_per_position"]) == a.num_accepted_tokens
        assert b.acceptance_rate is None
    self_spec = LLM(gqa_dir, draft_model=gqa_dir, spec_length=4).generate(prompts[:1], params)[0]
    assert self_spec.acceptance_rate == 1.0 and self_spec.mean_accepted_length > 3.0


def test_expected_acceptance_matches_realized():
    """The built-in monitor: mean sum_x min(p, q) over rounds agrees with the realized acceptance rate."""
    target, drafter = random_llama(8, 0), random_llama(8, 1, noise_from=0, noise=0.3)
    acc = 0
    expected = []
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        _, st = speculative_generate(target, drafter, [1, 2, 3, i % 8], SamplingParams(temperature=1.0, max_tokens=12),
                                     spec_length=3, eos_token_ids=[], generator=g)
        acc += sum(r.num_accepted for r in st.rounds)
        expected += [v for r in st.rounds for v in r.expected_accept[: r.tested]]
        assert st.realized_acceptance is not None and st.expected_acceptance is not None
    # A judged draft is accepted with probability exactly its sum_x min(p, q), so the accepted count is a sum of
    # Bernoullis with those means: it must lie within 4 standard deviations of their sum.
    mean = sum(expected)
    sd = sum(e * (1 - e) for e in expected) ** 0.5
    assert abs(acc - mean) < 4 * sd, (acc, mean, sd)
    assert 0.3 < mean / len(expected) < 0.8  # the pair really is a partial match, so the check has teeth


def test_egag_adapts_k_within_bounds_and_records_it(pair):
    target, drafter, _ = pair
    out, stats = speculative_generate(target, drafter, PROMPTS[0], SamplingParams(temperature=0, max_tokens=40),
                                      eos_token_ids=[], spec_length="egag", spec_length_min=2, spec_length_max=6)
    expected = autoregressive_generate(target, PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), []).output_ids
    assert out.output_ids == expected  # any K schedule is lossless
    ks = [r.k for r in stats.rounds]
    assert all(1 <= k <= 6 for k in ks) and all(r.h_norm is not None for r in stats.rounds)
    assert all(k >= 2 for k in ks[:-2])  # only the max_tokens cap may go below spec_length_min at the end


def test_egag_maps_entropy_to_gamma():
    e = EntropyAdaptiveGamma(2, 8)
    assert e.next_gamma() == 8  # nothing seen yet
    e.observe(torch.zeros(3, 16))  # uniform drafter: H_norm = 1 -> shortest drafts
    assert e.h_norm == pytest.approx(1.0) and e.next_gamma() == 2
    e.observe(torch.tensor([[100.0] + [0.0] * 15]))  # certain drafter: H_norm = 0
    assert e.next_gamma() == 8
    smooth = EntropyAdaptiveGamma(2, 8, ema_beta=0.5)
    smooth.observe(torch.zeros(1, 16))
    smooth.observe(torch.tensor([[100.0] + [0.0] * 15]))
    assert smooth.h_norm == pytest.approx(0.5, abs=1e-3) and smooth.next_gamma() == 5
    assert [k for _, k in smooth.history] == [5]


def test_theory_formulas():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(0.8, 10) == pytest.approx((1 - 0.8 ** 11) / 0.2)
    assert walltime_improvement(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
    # a verify that costs 1.25 target steps: same tokens per round, a dearer round
    assert walltime_improvement(0.8, 4, 0.1, verify_cost=1.25) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.65))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="verify_cost"):
            walltime_improvement(0.8, 4, 0.1, verify_cost=bad)
    # brute force: optimal_k maximises the improvement
    best = max(range(1, 65), key=lambda k: walltime_improvement(0.9, k, 0.05))
    assert optimal_k(0.9, 0.05) == best
    assert optimal_k(0.5, 0.5) == 1  # a weak, expensive drafter: draft little
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_round(1.5, 3)


def test_bad_input(gqa_dir, pair, tmp_path):
    target, drafter, _ = pair
    with pytest.raises(ValueError, match="spec_length"):
        speculative_generate(target, drafter, [1, 2], spec_length=0)
    with pytest.raises(ValueError, match="spec_length_min"):
        speculative_generate(target, drafter, [1, 2], spec_length="egag", spec_length_min=5, spec_length_max=3)
    with pytest.raises(ValueError, match="spec_length"):
        LLM(gqa_dir, draft_model=gqa_dir, spec_length=0)
    with pytest.raises(ValueError, match="spec_length_min"):
        LLM(gqa_dir, draft_model=gqa_dir, spec_length="egag", spec_length_min=4, spec_length_max=2)
    other = make_tiny_llama(tmp_path / "big_vocab", "gqa", vocab_size=400)
    with pytest.raises(ValueError, match=r"vocab_size 400 .* 320"):
        LLM(gqa_dir, draft_model=other)
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, load_model(other), [1, 2])


def test_drafter_with_another_tokenizer_drafts_across(gqa_dir, tmp_path):
    """Same vocabulary size, a different token -> id map: the drafter drafts through the text (proposers.
    cross_tokenizer), the command line says so in one line, and greedy output is the target's."""
    import json
    import shutil

    from test_cli import run

    d = shutil.copytree(gqa_dir, tmp_path / "other_tok")
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(gqa_dir, draft_model=d, spec_length=3)
    assert llm.engine.bridge is not None and llm.engine.bridge.num_shared > 300
    out = llm.generate(["def fib"], params)[0]
    assert out.token_ids == LLM(gqa_dir).generate(["def fib"], params)[0].token_ids and out.num_draft_tokens > 0
    r = run("generate", "--model", str(gqa_dir), "--draft-model", str(d), "--prompt", "def fib", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "its own vocabulary" in line]
    assert len(notes) == 1 and "320 tokens" in notes[0] and "re-tokenised" in notes[0], r.stderr


def test_debug_view_plain_text(pair, capsys):
    from infer.tokenizer import Tokenizer

    target, drafter, d = pair
    speculative_generate(target, drafter, PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), spec_length=3,
                         eos_token_ids=[], tokenizer=Tokenizer(d), debug=True)
    out = capsys.readouterr().out
    assert "round   1 K=3" in out and "\033[" not in out  # not a TTY: no colour codes
    assert ("-> recovered" in out) or ("-> bonus" in out)
    assert "no speculative round ran" not in out


def test_debug_view_says_so_where_no_round_ran(gqa_dir, pair, capsys):
    """One new token comes from the prompt's forward: no round runs, and the view says so instead of staying empty
    (as where auto K prices every step at k = 0), through both entries that print rounds."""
    from infer import LLM
    from infer.tokenizer import Tokenizer

    target, drafter, d = pair
    speculative_generate(target, drafter, PROMPTS[0], SamplingParams(temperature=0, max_tokens=1), spec_length=3,
                         eos_token_ids=[], tokenizer=Tokenizer(d), debug=True)
    assert "no speculative round ran" in capsys.readouterr().out
    llm = LLM(gqa_dir, draft_model=d, spec_length=2)
    llm.generate(["def fib"], SamplingParams(temperature=0, max_tokens=1), debug=True)
    assert "no speculative round ran" in capsys.readouterr().out
    llm.generate(["def fib"], SamplingParams(temperature=0, max_tokens=6), debug=True)
    out = capsys.readouterr().out
    assert "round   1 K=2" in out and "no speculative round ran" not in out
