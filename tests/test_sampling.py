"""The logits -> probs pipeline against hand-computed distributions, sampling exactness and reproducibility."""

import math

import pytest
import torch
from scipy.stats import chisquare

from infer.sampling import (IN_PROMPT, SamplingBatch, SamplingParams, argmax, logits_to_probs, make_generator,
                            penalty_context, sample)

P = torch.tensor([0.5, 0.25, 0.15, 0.1])
LOGITS = P.log()[None]  # softmax(LOGITS) == P


def probs(logits, seen=None, **kw):
    params = SamplingParams(**kw)
    batch = SamplingBatch.from_params([params], logits.shape[-1], "cpu")
    return logits_to_probs(logits, batch, seen)[0]


def close(a, b):
    return torch.allclose(a, torch.tensor(b, dtype=torch.float32), atol=1e-6)


def test_plain_softmax():
    assert close(probs(LOGITS), P.tolist())


def test_temperature():
    expected = P.sqrt() / P.sqrt().sum()  # p^(1/T) normalised, T = 2
    assert close(probs(LOGITS, temperature=2.0), expected.tolist())


def test_top_k():
    assert close(probs(LOGITS, top_k=2), [2 / 3, 1 / 3, 0, 0])
    assert close(probs(LOGITS, top_k=0), P.tolist())  # <= 0 is off
    assert close(probs(LOGITS, top_k=-1), P.tolist())
    assert close(probs(LOGITS, top_k=100), P.tolist())  # larger than the vocabulary: off


def test_top_p_keeps_smallest_prefix_reaching_p():
    assert close(probs(LOGITS, top_p=0.7), [2 / 3, 1 / 3, 0, 0])  # 0.5 < 0.7 <= 0.75
    assert close(probs(LOGITS, top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert close(probs(LOGITS, top_p=0.3), [1, 0, 0, 0])  # the top token always stays


def _kept_by_full_sort(logits, top_k, top_p):
    """The top-k / top-p rule over a whole sorted row: the kept tokens, ties with the last kept rank included."""
    kept = torch.zeros_like(logits, dtype=torch.bool)
    for b in range(logits.shape[0]):
        vals, order = logits[b].sort(descending=True)
        remove = torch.arange(len(vals)) >= top_k[b]
        if top_p[b] < 1.0:  # (the sort this replaced cut a top_p = 1 row too where a batch had top-p rows: its tail's
            # mass before rounds to 1.0 in float32; top_p = 1 is off)
            probs_sorted = vals.masked_fill(remove, float("-inf")).softmax(-1)
            remove |= probs_sorted.cumsum(-1) - probs_sorted >= top_p[b]
        kept[b] = logits[b] >= vals[~remove].min()
    return kept


@pytest.mark.parametrize("vocab,scale,bf16", [(50, 3.0, False), (1000, 3.0, False), (5000, 0.01, False),
                                              (5000, 1.0, False), (1000, 3.0, True)])
def test_top_k_top_p_candidates_keep_what_a_full_sort_keeps(vocab, scale, bf16):
    # The stage selects each row's largest logits (torch.topk), growing the candidates until they hold every top-p
    # row's mass; it must keep exactly the tokens a sort of the whole row keeps. Flat rows (scale 0.01) need nearly
    # the whole vocabulary (the candidates grow to it); peaked ones a few tokens; logits rounded to bfloat16 tie at
    # the boundaries (every tied token is kept). Rows mix top-k, top-p, both and neither in one batch.
    g = torch.Generator().manual_seed(vocab)
    settings = [dict(top_k=0, top_p=0.9), dict(top_k=20, top_p=1.0), dict(top_k=100, top_p=0.5),
                dict(top_k=0, top_p=0.99), dict(top_k=0, top_p=1.0), dict(top_k=3, top_p=0.3),
                dict(top_k=vocab + 5, top_p=0.95), dict(top_k=1, top_p=1.0)]
    params = [SamplingParams(temperature=0.8, **kw) for kw in settings for _ in range(4)]
    logits = torch.randn(len(params), vocab, generator=g) * scale
    if bf16:
        logits = logits.bfloat16().float()
        assert (logits[:, None, :] == logits[:, :, None]).sum() > 1.5 * logits.numel()  # ties beside the diagonal
    logits[0, : vocab // 2] = float("-inf")  # a grammar's mask: masked tokens are never kept
    batch = SamplingBatch.from_params(params, vocab, "cpu")
    out = logits_to_probs(logits, batch)
    expected = _kept_by_full_sort(logits / 0.8, batch.top_k, batch.top_p)
    assert torch.equal(out > 0, expected)
    assert torch.allclose(out, (logits / 0.8).masked_fill(~expected, float("-inf")).softmax(-1), atol=1e-6)


def test_top_k_wider_than_a_draft_vocabulary_is_off():
    # A drafter scores a draft vocabulary narrower than the batch's: a top-k at or past its width keeps it whole,
    # beside top-p rows
    params = [SamplingParams(top_k=60), SamplingParams(top_k=60, top_p=0.8)]
    out = logits_to_probs(LOGITS.repeat(2, 1), SamplingBatch.from_params(params, 100, "cpu"))
    assert close(out[0], P.tolist()) and close(out[1], [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_top_p_of_one_is_off_beside_top_p_rows():
    # A confident row's float32 mass reaches 1.0 after its first token: top_p = 1 must not cut its top-k there
    logits = torch.tensor([[30.0, 0.0, 0.0, -1.0, -2.0]]).repeat(2, 1)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5)]
    out = logits_to_probs(logits, SamplingBatch.from_params(params, 5, "cpu"))
    assert (out[0] > 0).tolist() == [True, True, True, False, False]
    assert (out[1] > 0).tolist() == [True, False, False, False, False]


def test_min_p():
    assert close(probs(LOGITS, min_p=0.25), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])  # threshold 0.125
    assert close(probs(LOGITS, min_p=0.4), [2 / 3, 1 / 3, 0, 0])  # threshold 0.2


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    seen = penalty_context([[0, 1, 1]], 4, "cpu")
    penalised = torch.tensor([1.0, -2.0, 0.5, 0.0])  # positive / 2, negative * 2, unseen unchanged
    assert close(probs(logits, seen, repetition_penalty=2.0), penalised.softmax(-1).tolist())
    with pytest.raises(ValueError, match="penalty context"):
        probs(logits, None, repetition_penalty=2.0)


def test_penalty_context_counts_the_output_and_flags_the_prompt():
    ctx = penalty_context([[0, 3, 3, 1, 1, 1], [2]], 4, "cpu", output_from=[3, 0])
    assert ctx.tolist() == [[IN_PROMPT, 3, 0, IN_PROMPT], [0, 0, 1, 0]]


def test_presence_and_frequency_penalties_follow_openais_formula():
    """logit - frequency x count(output) - presence x [count > 0], after the repetition penalty (vLLM's order);
    prompt tokens are not counted for the two (OpenAI's and vLLM's rule), a prompt token seen in the output is."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0]])
    ctx = penalty_context([[0, 4, 1, 1, 4]], 5, "cpu", output_from=[2])  # prompt 0 4, output 1 1 4
    want = logits[0] - 0.3 * torch.tensor([0, 2, 0, 0, 1]) - 0.5 * torch.tensor([0, 1, 0, 0, 1])
    got = probs(logits, ctx, presence_penalty=0.5, frequency_penalty=0.3)
    assert close(got, want.softmax(-1).tolist())
    rep = torch.tensor([1.0, -2.0, 0.5, 0.0, 0.5])  # repetition 2 over prompt and output: 0, 1, 4 seen
    want = rep - 0.3 * torch.tensor([0, 2, 0, 0, 1]) - 0.5 * torch.tensor([0, 1, 0, 0, 1])
    assert close(probs(logits, ctx, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.3),
                 want.softmax(-1).tolist())
    assert close(probs(logits, ctx, temperature=0.0, frequency_penalty=2.0), [1, 0, 0, 0, 0])
    assert close(probs(logits, ctx, temperature=0.0, presence_penalty=-2.0), [0, 0, 0, 0, 1])  # negative: favoured
    for bad in (2.5, -3, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="presence_penalty"):
            SamplingParams(presence_penalty=bad)


def test_logit_bias_is_added_first():
    """OpenAI's logit_bias: added to the raw logits before penalties and temperature; -100 bans in practice; JSON's
    string keys read as ids; out of range or not ids: a ValueError naming the field."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    want = (logits[0] + torch.tensor([0.0, 3.0, 0.0, -1.5])) / 0.5
    assert close(probs(logits, temperature=0.5, logit_bias={1: 3.0, "3": -1.5}), want.softmax(-1).tolist())
    assert close(probs(logits, temperature=0.0, logit_bias={0: -100}), [0, 0, 1, 0])
    ctx = penalty_context([[0]], 4, "cpu")  # the penalty sees the biased logit: (2 + 1) / 2
    assert close(probs(logits, ctx, repetition_penalty=2.0, logit_bias={0: 1.0}),
                 torch.tensor([1.5, -1.0, 0.5, 0.0]).softmax(-1).tolist())
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({-1: 1.0}, {2: 101.0}, {"x": 1.0}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias names token 9"):
        SamplingBatch.from_params([SamplingParams(logit_bias={9: 1.0})], 4, "cpu")


def test_stage_order_penalty_temperature_topk():
    logits = torch.tensor([[2.0, 1.8, 0.5, 0.0]])
    seen = penalty_context([[0]], 4, "cpu")
    # penalty: [1.0, 1.8, 0.5, 0.0] -> /T=0.5: [2.0, 3.6, 1.0, 0.0] -> top-2: tokens 1 and 0
    e = torch.tensor([3.6, 2.0]).softmax(-1)
    assert close(probs(logits, seen, repetition_penalty=2.0, temperature=0.5, top_k=2), [e[1], e[0], 0, 0])


def test_greedy_is_one_hot_on_penalised_argmax():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    assert close(probs(logits, temperature=0.0), [1, 0, 0, 0])
    seen = penalty_context([[0]], 4, "cpu")
    assert close(probs(logits, seen, temperature=0.0, repetition_penalty=2.0), [0, 1, 0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_takes_the_first_maximum_like_torch_argmax(dtype):
    # Greedy parity rests on every path breaking ties the same way: many ties per row, vocab sizes around the
    # vectorisation widths.
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 1), (1, 7), (3, 8192), (5, 8191), (9, 33), (2, 8193)]:
        x = torch.randint(0, 3, (rows, vocab), generator=g).to(dtype)
        assert torch.equal(argmax(x), x.argmax(-1))
    x = torch.tensor([[0.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0]], dtype=dtype)
    assert argmax(x).tolist() == [1, 0]


def test_mixed_rows_in_one_batch():
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(top_p=0.8)]
    out = logits_to_probs(logits, SamplingBatch.from_params(params, 4, "cpu"))
    assert close(out[0], [1, 0, 0, 0]) and close(out[1], [2 / 3, 1 / 3, 0, 0])
    assert close(out[2], [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_a_batchs_tensors_are_built_once_per_law_and_follow_a_changed_params():
    """from_params shares its tensors between calls with the same laws (a speculating engine asks every round), by
    value: a SamplingParams changed in between is read anew. Each caller gets the kind of tensor it would have built:
    inference tensors in inference mode (what a compiled draft round was traced with), ordinary ones outside it (a
    caller under autograd may read them); and each batch names the params it was given."""
    import infer.sampling as sampling

    a, b = SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.9, top_p=0.8)
    with torch.inference_mode():
        first = SamplingBatch.from_params([a, b], 100, "cpu")
        assert SamplingBatch.from_params([a, b], 100, "cpu").temperature is first.temperature
    assert first.temperature.is_inference()
    again = SamplingBatch.from_params([SamplingParams(temperature=0.7, top_k=5), b], 100, "cpu")
    assert again.temperature is not first.temperature and not again.temperature.is_inference()
    assert SamplingBatch.from_params([a, b], 100, "cpu").temperature is again.temperature
    assert again.rows[1] is b and again.use_top_k and again.use_top_p and not again.all_greedy
    a.temperature = 0.0  # now greedy: other tensors and flags
    changed = SamplingBatch.from_params([a, b], 100, "cpu")
    assert changed.temperature.tolist() == [1.0, pytest.approx(0.9)] and changed.greedy.tolist() == [True, False]
    assert not changed.use_top_k  # a greedy row's top-k is no stage
    assert SamplingBatch.from_params([a, b], 50, "cpu").top_k.tolist() == [5, 50]  # the vocabulary is in the key
    logits = torch.randn(2, 100, requires_grad=True)
    logits_to_probs(logits, again, None).sum().backward()  # no inference tensor saved for backward
    for i in range(sampling._BATCHES_MAX + 1):  # bounded: full, it starts over
        SamplingBatch.from_params([SamplingParams(temperature=0.5 + i / 1000)], 100, "cpu")
    assert len(sampling._BATCHES) <= sampling._BATCHES_MAX


def test_sample_follows_the_distribution():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0]])
    g = make_generator(0)
    n = 4000
    draws = torch.stack([sample(p, [g]) for _ in range(n)]).flatten()
    counts = torch.bincount(draws, minlength=5)
    assert counts[4] == 0  # zero probability is never drawn
    assert chisquare(counts[:4].numpy(), (p[0, :4] * n).numpy()).pvalue > 0.001


def test_seed_reproduces_and_differs():
    p = torch.full((1, 50), 1 / 50)
    a = [int(sample(p, [g])) for g in [make_generator(7)] for _ in range(20)]
    g = make_generator(7)
    b = [int(sample(p, [g])) for _ in range(20)]
    g = make_generator(8)
    c = [int(sample(p, [g])) for _ in range(20)]
    assert a == b and a != c


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5),
    ("top_k", 2.5), ("repetition_penalty", 0.0), ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", "x"),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
