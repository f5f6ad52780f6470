"""Proposers and the K policy: prompt lookup finds what it should, every proposer and K schedule keeps greedy
parity on both KV backends, the goodput policy drafts when it pays and falls to K = 0 when it does not."""

from types import SimpleNamespace

import pytest

from infer import LLM, SamplingParams
from infer.engine import Engine, EngineConfig
from infer.model import load_model
from infer.request import Request
from infer.speculative import speculative_generate
from infer.proposers.ngram import NgramProposer
from infer.spec_decode.cost_model import CostModel
from infer.spec_decode.spec_length import GoodputSpecLength, expected_tokens
from infer.testing import make_tiny_llama


def _req(ids):  # a greedy request (auto K's estimate of a sampled one remembers longer: DRAWN_DECAY)
    return Request(ids, SamplingParams(temperature=0, max_tokens=50))


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
                                                  ("hybrid", "auto"), ("suffix-hybrid", "auto"), ("draft", "auto")])
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
    c.refresh_verify(1, 1, 100.0)  # an outlier counts as at most OUTLIER x the price it had
    assert c.verify_cost(1, 1) == pytest.approx(c.OUTLIER)
    assert c.verify_cost(1, 3) == pytest.approx(1.5 * c.OUTLIER)  # one width measured: a factor for every width of B
    assert c.verify_cost(2, 1) == pytest.approx(4 / 3 * c.OUTLIER)  # a batch size not measured yet: the latest level
    for _ in range(40):  # B = 4 runs 1.5x its profile at every width: the line is that factor
        c.refresh_verify(4, 5, 9.0)
        c.refresh_verify(4, 1, 3.0)
    a, b = c.line(4)
    assert b == pytest.approx(1.5, rel=1e-6) and abs(a) < 1e-6
    assert c.verify_cost(4, 3) == pytest.approx(1.5 * 4.0) and c.verify_cost(1, 1) == pytest.approx(2.0)
    for _ in range(40):  # B = 1 at a long context: +0.5 s a forward at every width, the per-token part as profiled
        c.refresh_verify(1, 5, 2.5)
        c.refresh_verify(1, 1, 1.5)
    a, b = c.line(1)  # the widths' spread fits the offset, where a factor would price the widths 1.5 : 2.5 as 1 : 2
    assert a == pytest.approx(0.5, abs=0.05) and b == pytest.approx(1.0, abs=0.05)
    assert c.verify_cost(1, 3) == pytest.approx(2.0, rel=0.01)
    for _ in range(100):  # a line falling below the floor (faster than profiled by more than the offset) stays > 0
        c.refresh_verify(1, 5, 0.01)
        c.refresh_verify(1, 1, 0.5)
    assert c.verify_cost(1, 5) >= 0.25 * 2.0
    for B in (1, 2, 4, 8):  # the prices of every width at once (auto K's) are the prices one at a time
        assert c.verify_costs(B, 5) == [0.0] + [c.verify_cost(B, T) for T in range(1, 6)]
    # a ragged forward (rows drafting unequal K, the pads skipped) is priced by its real tokens: 4 rows, one of them
    # drafting 4, are 4 x 2 tokens, the profile at T = 2 (fractional T between the cells around it)
    d = CostModel.from_points(4, 4, {(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 6.0}, {1: 0.1})
    assert d.verify_cost(4, 2.0) == pytest.approx(3.0) and d.verify_cost(4, 1.5) == pytest.approx(2.5)
    d.refresh_verify(4, 1.5, 5.0)  # and refreshes its line there: 5 s against 2.5 profiled
    assert d.verify_cost(4, 1.5) > 2.5 * 1.5


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
    # the profile's prices never fall with width (a narrow forward slowed by the host is lowered to the wider one's:
    # equal, on a tiny model whose forward is mostly fixed cost; `> 1` failed 1 run in ~6 on a busy host)
    assert ratio >= 1.0


def test_goodput_margin_set_up_cost_and_probe_backoff(monkeypatch):
    from infer.spec_decode import spec_length as sl

    def linear_costs(step):  # verify(1, T) = 1 + step (T - 1), a draft step 0.1
        return CostModel.from_points(1, 6, {(1, 1): 1.0, (1, 7): 1.0 + 6 * step}, {1: 0.1})

    r = _req([1, 2])  # a = 0.6 (the prior): k = 1 predicts 1.6 / 1.5 = 1.067x plain decoding, more k less
    assert GoodputSpecLength(6, linear_costs(0.4)).choose([r], [6]) == [0]  # a gain inside MARGIN: plain
    monkeypatch.setattr(sl, "MARGIN", 0.0)
    assert GoodputSpecLength(6, linear_costs(0.4)).choose([r], [6]) == [1]
    monkeypatch.undo()

    # a lazy prefill of 200 tokens costs 2 verifies: spread over the request's rounds left it pays, but not for the
    # round or two a batch that just shrank keeps its size (a neighbour's replacement is prefilling)
    policy = GoodputSpecLength(6, CostModel.from_points(2, 6, {(1, 1): 1.0, (1, 7): 1.12, (2, 1): 1.0, (2, 7): 9.0},
                                                         {1: 0.1, 2: 0.1}))
    policy.costs.catch_up, policy.pending = 0.01, lambda req: 200
    assert policy.choose([r], [6])[0] > 0  # a request joined: it stays for its tokens
    assert policy.choose([r, _req([3])], [6, 6]) == [0, 0]  # two rows: verifying is dear
    assert policy.choose([r], [6]) == [0]  # shrank: the catch-up would be paid for one round
    assert any(policy.choose([r], [6])[0] > 0 for _ in range(5))  # it kept its size: amortised over more
    policy.pending = lambda req: 0
    policy.choose([r, _req([3])], [6, 6])
    assert policy.choose([r], [6])[0] > 0  # nothing to catch up: a shrunk batch drafts at once

    # one rejected draft (a probe, the first round of a sampled request) does not send every later request to k = 0
    policy = GoodputSpecLength(6, linear_costs(0.3))
    policy.observe(_req([4]), 1, 0)
    assert policy.choose([_req([5])], [6]) == [1]

    # a row whose drafts fail sits at k = 0 and probes with one draft after 16 rounds, then 32, 64 (no reset)
    policy = GoodputSpecLength(6, linear_costs(0.05))
    for _ in range(20):
        policy.observe(r, 4, 0)
    probes = [i for i in range(1, 130) if policy.choose([r], [6]) == [1]]
    assert probes == [sl.PROBE_EVERY, 3 * sl.PROBE_EVERY, 7 * sl.PROBE_EVERY]

    # where no probe can pay (two rows, verifying dear), a due probe is skipped and asked about again a period later,
    # not every round after (the price of a probe was half of choose's at 8 rows); it probes once it can pay
    policy = GoodputSpecLength(6, CostModel.from_points(2, 6, {(1, 1): 1.0, (1, 7): 1.12, (2, 1): 1.0, (2, 7): 9.0},
                                                         {1: 0.1, 2: 0.1}))
    policy.explore_every = 1 << 20  # probes alone (no exploration round drafting 2 meanwhile)
    a, b = _req([6]), _req([7])
    for x in (a, b):
        for _ in range(20):
            policy.observe(x, 4, 0)
    priced = []
    best = policy._best
    policy._best = lambda *args, **kw: priced.append(len(args[0])) or best(*args, **kw)
    assert all(policy.choose([a, b], [6, 6]) == [0, 0] for _ in range(4 * sl.PROBE_EVERY))
    assert priced.count(2) == 4 * sl.PROBE_EVERY + 4  # every round's choice, and a probe's price per period
    assert any(policy.choose([a], [6]) == [1] for _ in range(sl.PROBE_EVERY))  # alone a probe pays



def test_a_drawn_rows_estimate_remembers_longer_than_a_greedy_ones(monkeypatch):
    """A drawn draft is accepted by a coin of its own, so an unlucky run of rounds says little about a sampled row's
    next ones: its estimate (DRAWN_DECAY, DRAWN_PRIOR_WEIGHT) keeps it drafting where a greedy row's, which follows
    the text, stops. A sampled row whose drafts keep failing still stops, a few rounds later."""
    from infer.spec_decode import spec_length as sl

    costs = CostModel.from_points(1, 6, {(1, 1): 1.0, (1, 7): 1.0 + 6 * 0.3}, {1: 0.1})  # k > 0 pays from a ~ 0.55
    greedy, drawn = _req([1, 2]), Request([1, 2], SamplingParams(temperature=0.7, max_tokens=50))
    policy = GoodputSpecLength(6, costs)
    for _ in range(10):  # two of three drafts accepted, then four rounds whose first draft is rejected
        for r in (greedy, drawn):
            policy.observe(r, 4, 2)
    assert policy.choose([greedy], [6])[0] > 0 and policy.choose([drawn], [6])[0] > 0
    for _ in range(4):
        for r in (greedy, drawn):
            policy.observe(r, 4, 0)
    assert policy.alpha(drawn) > 0.55 > policy.alpha(greedy)
    assert policy.choose([greedy], [6]) == [0]
    assert policy.choose([drawn], [6])[0] > 0
    # with the greedy rows' memory the sampled row would have stopped too
    old = GoodputSpecLength(6, costs)
    old.global_accepted, old.global_judged = policy.global_accepted, policy.global_judged
    monkeypatch.setattr(sl, "DRAWN_DECAY", sl.DECAY)
    monkeypatch.setattr(sl, "DRAWN_PRIOR_WEIGHT", sl.PRIOR_WEIGHT)
    again = Request([1, 2], SamplingParams(temperature=0.7, max_tokens=50))
    for n in [2] * 10 + [0] * 4:
        old.observe(again, 4, n)
    assert old.choose([again], [6]) == [0]
    monkeypatch.undo()
    # a sampled row whose drafts all fail, beside a row whose drafts all pass (the engine's mean stays high): stops
    policy = GoodputSpecLength(6, costs)
    bad, good = Request([3], SamplingParams(temperature=0.7, max_tokens=50)), _req([4])
    stopped = []
    for i in range(60):
        policy.observe(bad, 4, 0)
        policy.observe(good, 4, 4)
        if policy.choose([bad], [6]) == [0]:
            stopped.append(i)
    assert policy.global_accepted / policy.global_judged > 0.7
    assert stopped and 3 <= stopped[0] < 40


def test_pricing_backs_off_where_its_answers_do_not_pay_for_it():
    """Where choose's answers gain less than choose costs (a forward priced at microseconds: any Python costs more),
    it prices one round in PRICE_EVERY_MAX and answers k = 0 meanwhile; an answer that drafts brings back pricing
    every round."""
    from infer.spec_decode import spec_length as sl

    costs = CostModel.from_points(2, 6, {(1, 1): 1e-6, (1, 7): 1.1e-6, (2, 1): 1e-6, (2, 7): 2.2e-6},
                                  {1: 1e-8, 2: 1e-8})
    policy = GoodputSpecLength(6, costs)
    policy.explore_every = 1 << 20
    a, b = _req([6]), _req([7])
    for x in (a, b):
        for _ in range(20):
            policy.observe(x, 4, 0)  # every draft rejected: k = 0 pays best
    priced = []
    offers = policy.offers
    policy.offers = lambda reqs, caps: priced.append(len(reqs)) or offers(reqs, caps)
    answers = [policy.choose([a, b], [6, 6]) for _ in range(64)]
    assert len(priced) <= 64 // sl.PRICE_EVERY_MAX + 3  # 1, 2, then 4 rounds apart
    assert sum(map(any, answers)) <= 1  # k = 0 (but a probe due)
    for x in (a, b):
        for _ in range(20):
            policy.observe(x, 4, 4)  # now every draft is accepted: drafting pays
    n = len(priced)
    answers = [policy.choose([a, b], [6, 6]) for _ in range(24)]
    first = next(i for i, ks in enumerate(answers) if any(ks))
    assert first < sl.PRICE_EVERY_MAX  # found at the next priced round
    assert all(min(ks) > 0 for ks in answers[first:])  # and from there every round is priced, and drafts
    assert len(priced) - n == 1 + 24 - 1 - first


def test_best_k_is_the_best_rate_over_every_k_and_rows_drafting():
    """_best against the rate of every (k, m) computed out: the m most promising rows draft k, priced by verify (of
    the rows' real tokens: B x (1 + their drafts / B), the pads skipped), draft and set-up costs (the policy's
    docstring)."""
    import random

    from infer.spec_decode import spec_length as sl

    rnd = random.Random(0)
    costs = CostModel.from_points(8, 6, {(1, 1): 1.0, (1, 7): 2.5, (8, 1): 2.0, (8, 7): 12.0}, {1: 0.1, 8: 0.3})
    policy = GoodputSpecLength(6, costs)
    sheets = {B: sl._Sheet(costs, B, 6) for B in range(1, 9)}  # one per batch size, shared by every pricing below
    for _ in range(300):
        B = rnd.randint(1, 8)
        alphas = [rnd.random() for _ in range(B)]
        caps = [rnd.choice([0, 1, 3, 6]) for _ in range(B)]
        free = [rnd.random() < 0.5 for _ in range(B)]
        curves = [policy.calibration.curve([rnd.random() for _ in range(6)], 6) if f and rnd.random() < 0.5 else None
                  for f in free]
        setup = [(rnd.choice([0.0, 0.05]), rnd.randint(1, 50)) for _ in range(B)]
        got = policy._best(alphas, caps, setup, 1 << 30, free, curves)
        # the prices read once for a choose's every pricing (its row caps and copies differ) give the same answer
        assert policy._best(alphas, caps, setup, 1 << 30, free, curves, sheets[B]) == got
        order = policy._order(alphas, caps)
        want = (B / costs.verify_cost(B, 1) * (1 + sl.MARGIN), 0, 0)
        rows = [b for b in order if caps[b]]
        for k in range(1, min(6, max(caps)) + 1):
            for m in range(1, len(rows) + 1):
                total, setup_s, models, drafts = float(B), 0.0, 0, 0
                for b in rows[:m]:
                    e = curves[b] if curves[b] is not None else [sl.expected_tokens(alphas[b], j) for j in range(7)]
                    x = e[min(k, caps[b])]
                    total += x - 1.0
                    drafts += min(k, caps[b])
                    models += not free[b]
                    if setup[b][0] and not free[b]:
                        setup_s += setup[b][0] * max(x / max(x, setup[b][1]), 1.0 / (1 << 30))
                rate = total / (costs.verify_cost(B, 1 + drafts / B) + costs.draft_cost(models, k) + setup_s)
                if rate > want[0]:
                    want = (rate, k, m)
        assert got[1:] == want[1:] and got[0] == pytest.approx(want[0])
    # The bound that answers without the search (no k beats plain decoding if a row's most at its cap cannot) reads
    # each row at its cap: where a round's bookkeeping makes one draft a loss and six a gain, the row drafts several.
    policy.overhead = {(1, False): 0.0, (1, True): 1.0}
    for curve in (None, policy.calibration.curve([0.99] * 6, 6)):
        rate, k, m = policy._best([0.95], [6], None, 1 << 30, [curve is not None], [curve])
        one = (sl.expected_tokens(0.95, 1) if curve is None else curve[1]) / (costs.verify_cost(1, 2) + 1.0)
        assert one < 1 / costs.verify_cost(1, 1) and k >= 3 and m == 1

def test_a_long_catch_up_is_fed_alone_and_the_budget_counts_one_token_a_row(pair, gqa_dir):
    """A request that joins a drafting batch brings its whole prompt to the drafter: fed alone, not padded into the
    batched draft step (which would cost B prompts). Speculation does not shrink the prefill budget."""
    from infer.proposers.draft_model import CATCH_UP_BATCHED

    _, _, d = pair
    eng = Engine(EngineConfig(model=gqa_dir, draft_model=d, spec_length=2, max_batch_size=2))
    assert eng.kv.decode_tokens(2) == 2  # K_max + 1 = 3 a row before
    widths = []
    forward = eng.decoder.proposer.forward
    eng.decoder.proposer.forward = lambda m, pool, slots, rows: widths.append([len(x) for x in rows]) or \
        forward(m, pool, slots, rows)
    params = SamplingParams(temperature=0, max_tokens=12)
    long_prompt = [0] + list(range(40, 70))
    a = eng.add_request([0, 5, 6], params)
    for _ in range(3):
        eng.step()
    b = eng.add_request(long_prompt, params)
    eng.run([a, b])
    assert [len(long_prompt)] in widths, widths  # b's prompt and first token, alone (its last goes with the batch)
    assert all(max(w) <= CATCH_UP_BATCHED for w in widths if len(w) > 1)
    plain = LLM(gqa_dir).generate([[0, 5, 6], long_prompt], params)
    assert [a.output_ids, b.output_ids] == [o.token_ids for o in plain]


def test_a_draft_price_a_stall_set_falls_to_the_first_fast_measurement():
    """A profile taken while the machine was busy (another engine compiling) priced a draft step 400x its cost; an
    EMA from there needed ~30 drafting rounds, which a priced-out drafter only gets from rare explorations: a
    measurement under half the price replaces it, one above moves it by the usual EMA (at most to twice the price)."""
    c = CostModel.from_points(1, 6, {(1, 1): 1.0, (1, 7): 1.6}, {1: 0.365})
    assert c.draft_cost(1, 2) == pytest.approx(0.73)  # nothing measured: the profile
    c.refresh_draft(1, 2, 0.0016)
    assert c.draft_cost(1, 2) == pytest.approx(0.0016)
    c.refresh_draft(1, 2, 0.1)  # slower: an EMA step, the stall's sample capped at twice the price
    assert c.draft_cost(1, 2) == pytest.approx(0.0016 + 0.2 * 0.0016)
    c.refresh_catch_up(10, 10 * 0.5)
    c.refresh_catch_up(10, 10 * 0.01)
    assert c.catch_up == pytest.approx(0.01)


def test_a_profile_point_above_a_wider_or_larger_one_is_cut_to_it():
    """Profiling's best-of-N still read a 1-token forward of the demo pair at 7.5 ms and a 2-token one at 3.6 (the
    machine busy at that moment): more tokens or rows never cost less, so such a point takes its wider neighbour's."""
    from infer.spec_decode.cost_model import profile_costs

    def run_verify(b, t):  # 3 + 0.5 t a row, but one row's 1-token forward slowed to 7.5 and 4-token one to 11
        return {(1, 1): 7.5, (1, 4): 11.0}.get((b, t), b * (3.0 + 0.5 * t))

    c = profile_costs(run_verify, lambda b: 0.1, profile_batch=2, k_max=3, max_batch=2, repeats=1)
    assert c.verify[1][4] == pytest.approx(10.0)  # cut to 2 rows' 4-token forward
    assert c.verify[1][2] == pytest.approx(4.0) and c.verify[1][1] == pytest.approx(4.0)  # cut to 2 tokens'
    assert [c.verify[2][t] for t in (1, 2, 4)] == pytest.approx([7.0, 8.0, 10.0])  # untouched


def test_a_round_is_priced_by_its_number_of_drafts():
    """A round's first step carries its set-up, and a compiled round's call costs more than its steps (SmolLM2's
    EAGLE-3 head, Zen 4: ~1.2 ms a call, ~0.17 ms a step). The traps this avoids: every step priced at what one-step
    rounds measured (auto K stopped drafting on a drafter that pays at k = 4), and later steps priced at their mean
    over rounds of every length (long rounds at a multiple of their cost while rounds of 2 were the common ones).
    Each k is priced as measured, and a k not measured yet off the line through those that were."""
    c = CostModel.from_points(1, 6, {(1, 1): 1.0, (1, 7): 1.6}, {1: 0.1})
    assert c.draft_cost(1, 4) == pytest.approx(0.4) and c.draft_cost(0, 4) == 0.0 and c.draft_cost(1, 0) == 0.0
    for _ in range(40):  # rounds of 2 drafts: one call (0.5) and its 2 steps (0.03 each)
        c.refresh_draft(1, 2, 0.56)
    assert c.draft_cost(1, 2) == pytest.approx(0.56, rel=1e-3)
    assert c.draft_cost(1, 4) == pytest.approx(0.56 * 2, rel=1e-3)  # one k measured: the profile scaled to it
    for _ in range(40):  # rounds of 3 drafts: the same call, 3 steps
        c.refresh_draft(1, 3, 0.59)
    assert c.draft_cost(1, 2) == pytest.approx(0.56, rel=1e-3) and c.draft_cost(1, 3) == pytest.approx(0.59, rel=1e-3)
    assert c.draft_cost(1, 5) == pytest.approx(0.5 + 5 * 0.03, rel=1e-3)  # off the line through them
    policy = GoodputSpecLength(6, c)
    r = _req([1, 2])
    for _ in range(10):
        policy.observe(r, 4, 3)  # a ~ 0.75
    k = policy.choose([r], [6])[0]
    # the old prices: a round's first step (0.5) and each later step at the rounds' mean (0.03 + 0.5 / 2 ~ 0.28 from
    # the rounds of 2 drafts, the common ones) draft shorter
    old = CostModel.from_points(1, 6, {(1, 1): 1.0, (1, 7): 1.6}, {1: 0.28})
    old.draft_first[1] = 0.53
    assert old.draft_cost(1, 4) == pytest.approx(0.53 + 3 * 0.28)
    old_policy = GoodputSpecLength(6, old)
    old_policy.state = policy.state
    assert k >= 5 and old_policy.choose([r], [6])[0] <= 3
    # a sample under half a k's price replaces it, as for every price (a stall while it was measured)
    c.refresh_draft(1, 3, 0.02)
    assert c.draft_cost(1, 3) == pytest.approx(0.02)
    # more drafts never cost less: a price above a longer round's (a stall's EMA) is cut to it
    assert c.draft_cost(1, 2) == pytest.approx(0.02) and c.rounds[1][2] == pytest.approx(0.56, rel=1e-3)
    assert c.draft_cost(1, 1) == pytest.approx(0.02)  # not measured: the line's price, cut the same way
    # a round's prices at every k at once (auto K's search: the line fitted once) are the prices one by one
    assert c.draft_costs(1, 6) == [c.draft_cost(1, k) for k in range(7)] and c.draft_costs(0, 3) == [0.0] * 4


def test_an_overpriced_drafter_is_re_measured_by_exploration_rounds():
    """A draft step priced far above its cost (a stall while it was measured, a profile stored on a busy machine)
    sends every row to k = 0; with no drafting round nothing would correct it. Every EXPLORE_EVERY rounds (then
    twice as many) the best row drafts 2, which re-measures the price, and drafting resumes once it is right."""
    from infer.spec_decode import spec_length as sl

    policy = GoodputSpecLength(6, CostModel.from_points(1, 6, {(1, 1): 1.0, (1, 7): 1.3}, {1: 5.0}))
    r = _req([1, 2])
    for _ in range(10):
        policy.observe(r, 4, 4)  # a row the drafter predicts well
    rounds = [policy.choose([r], [6]) for _ in range(3 * sl.EXPLORE_EVERY + 1)]
    explored = [i + 1 for i, ks in enumerate(rounds) if ks[0] >= 2]
    assert explored == [sl.EXPLORE_EVERY, 3 * sl.EXPLORE_EVERY]  # then 2x as long between them
    assert all(ks[0] <= 1 for i, ks in enumerate(rounds) if i + 1 not in explored)
    for _ in range(30):  # what exploration rounds measure: a step costs 0.02 of a decode
        policy.drafted(1, 2, 0.03, 0.02)
    assert policy.choose([r], [6])[0] >= 3
    assert policy.explore_every == sl.EXPLORE_EVERY  # drafting by choice resets the back-off


def test_free_drafts_are_priced_and_estimated_apart_from_the_model():
    """A hybrid's row with an n-gram match drafts without model steps: it drafts (up to the match's length) even where
    the model's steps are too dear, and its acceptance does not move the model's estimate."""
    policy = GoodputSpecLength(6, CostModel.from_points(2, 6, {(1, 1): 1.0, (1, 7): 1.3, (2, 1): 1.0, (2, 7): 1.5},
                                                         {1: 5.0, 2: 5.0}))
    copy, other = _req([1, 2]), _req([3, 4])
    policy.free = lambda req, k: min(k, 3) if req is copy else None
    for _ in range(5):
        policy.observe(copy, 3, 3, free=True)
        policy.observe(other, 4, 0)
    assert policy.alpha(copy, free=True) > 0.8 and policy.alpha(copy) == pytest.approx(policy.alpha(_req([9])))
    assert policy.choose([copy, other], [6, 6]) == [3, 0]
    policy.free = lambda req, k: None
    assert policy.choose([copy, other], [6, 6]) == [0, 0]  # the same rows drafted by the model: too dear


def test_a_row_a_hybrid_drafts_either_way_is_priced_both_ways():
    """A hybrid's row with a copy on offer may take the model's drafts instead (Proposer.drafts_either_way): auto K
    prices it both ways and declines the copy (``decline``) where the model's drafts are worth more, row by row.
    Without a decline (or with ``dual`` off) an offered row is priced as a copy only: a copy worth nothing decodes
    plainly even where the model's drafts would pay."""
    # a verify costs 1 + 0.2 per draft a row: a copy accepted 1 time in 4 does not pay for its verify
    costs = CostModel.from_points(2, 6, {(1, 1): 1.0, (1, 7): 2.2, (2, 1): 1.0, (2, 7): 2.2}, {1: 0.05, 2: 0.06})
    policy = GoodputSpecLength(6, costs)
    bad, good = _req([1, 2]), _req([3, 4])  # copies offered to both; bad's are rejected, the model's accepted
    policy.free = lambda req, k: min(k, 3)
    for _ in range(8):
        policy.observe(bad, 3, 0, free=True)
        policy.observe(bad, 4, 4)
        policy.observe(good, 3, 3, free=True)
        policy.observe(good, 4, 0)
    assert policy.alpha(bad, free=True) < 0.3 < 0.8 < policy.alpha(bad)
    assert policy.alpha(good) < 0.3 < 0.8 < policy.alpha(good, free=True)
    assert policy.choose([bad], [6]) == [0]  # priced as a copy only: plain decoding
    declined = []
    policy.decline = declined.append
    assert policy.choose([bad], [6])[0] >= 3 and declined == [bad]  # the model's drafts: K past the copy's 3
    declined.clear()
    assert policy.choose([good], [6]) == [3] and declined == []  # the copy wins: kept
    ks = policy.choose([bad, good], [6, 6])
    assert ks[0] > 0 and ks[1] == 3 and declined == [bad]  # each row its own way, in one round
    declined.clear()
    policy.dual = False
    assert policy.choose([bad, good], [6, 6]) == [0, 3] and declined == []


def test_confident_free_drafts_are_priced_by_their_confidence_as_calibrated():
    """With the proposer's confidence in each free draft (a suffix tree's counts), a row's expected tokens follow it:
    a run of sure copies drafts long where one rate per row would cut it short, a draft that trails off is cut where
    it stops paying, and what the target then accepts re-calibrates the confidences."""
    from infer.spec_decode.spec_length import Calibration

    costs = CostModel.from_points(1, 8, {(1, 1): 1.0, (1, 9): 2.6}, {})  # a verify costs 1 + 0.2 per draft
    policy = GoodputSpecLength(8, costs)
    r = _req([1, 2])
    conf = {"sure": [0.99] * 8, "trailing": [0.95, 0.95, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]}
    shape = "sure"
    policy.free = lambda req, k: min(k, 8)
    policy.confidence = lambda req, k: conf[shape][:k]
    for _ in range(3):  # a middling rate per row: 0.5
        policy.observe(r, 4, 1, free=True)
    assert policy.choose([r], [8]) == [8]
    shape = "trailing"
    assert policy.choose([r], [8]) == [2]
    policy.confidence = lambda req, k: None  # the same row priced by its rate alone
    assert policy.choose([r], [8])[0] < 8

    cal = Calibration()
    assert cal(0.95) == pytest.approx(0.95) and cal(0.05) == pytest.approx(0.05)  # trusted before any draft
    for _ in range(400):  # drafts of confidence 0.95 turn out right half the time
        cal.observe(0.95, True)
        cal.observe(0.95, False)
    assert cal(0.95) == pytest.approx(0.5, abs=0.02) and cal(0.05) == pytest.approx(0.05)
    assert cal.curve([0.95, 0.95], 4) == pytest.approx([1.0, 1.5, 1.75, 1.75, 1.75], abs=0.02)
    # the policy learns from what the target judged: drafts 0..n accepted, the next one rejected
    policy = GoodputSpecLength(8, costs)
    policy.free, policy.confidence = (lambda req, k: min(k, 8)), (lambda req, k: [0.55] * k)
    policy.choose([r], [8])
    policy.observe(r, 3, 1, free=True)
    assert policy.calibration.judged[5] == pytest.approx(4.0 * 0.995 ** 2 + 0.995 + 1.0)  # two judged: 1 right
    assert policy.calibration(0.55) < 0.55


def test_confidence_groups_are_calibrated_apart():
    """Confidences in different groups (Proposer.confidence_group: a suffix tree's short and long matches) learn
    their acceptance apart: the same 0.95 from a group whose drafts keep failing is priced short, from a group whose
    drafts hold it is priced long."""
    costs = CostModel.from_points(1, 8, {(1, 1): 1.0, (1, 9): 2.6}, {})  # a verify costs 1 + 0.2 per draft
    policy = GoodputSpecLength(8, costs)
    short, long_ = _req([1, 2]), _req([3, 4])
    policy.free = lambda req, k: min(k, 8)
    policy.confidence = lambda req, k: [0.95] * k
    policy.group = lambda req, k: 0 if req is short else 3
    assert policy.choose([short], [8]) == policy.choose([long_], [8]) == [8]  # one prior for both
    for _ in range(60):  # short matches' drafts: the first right, the second wrong; long ones: all right
        policy.choose([short], [8])
        policy.observe(short, 8, 1, free=True)
        policy.choose([long_], [8])
        policy.observe(long_, 8, 8, free=True)
    assert set(policy.calibrations) == {0, 3} and policy.calibration is policy.calibrations[0]
    assert policy.calibrations[0](0.95) < 0.6 < 0.95 < policy.calibrations[3](0.95) + 0.01
    assert policy.choose([short], [8])[0] < 8 and policy.choose([long_], [8]) == [8]


def test_auto_k_verifies_the_drafts_worth_it_by_the_drafters_confidence():
    """Once drafted, auto K verifies a prefix of each model row's drafts (GoodputSpecLength.cut): a draft is worth
    the chance it is reached and accepted (the calibrated confidences before it, multiplied) against its share of the
    verify at the round's rate. Greedy rows only; copies (no confidence), drawn drafts and pinned K verify every
    draft. What the target then judges re-calibrates the confidences, and the row's estimate still counts the drafts
    the cut left out."""
    from infer.spec_decode.spec_length import FixedSpecLength

    nan = float("nan")
    costs = CostModel.from_points(2, 8, {(1, 1): 1.0, (1, 9): 2.6, (2, 1): 1.0, (2, 9): 4.2}, {1: 0.1, 2: 0.1})
    policy = GoodputSpecLength(8, costs)  # a verify: 1 + 0.2 a draft (one row), 1 + 0.2 a draft of either row (two)
    r, s = _req([1, 2]), _req([3, 4])
    assert policy.cut([r], [4], [[0.99] * 4], None, [False]) == [4]  # sure drafts: all verified
    assert policy.cut([r], [4], [[0.99, 0.99, 0.05, 0.99]], None, [False]) == [2]  # a doubted draft ends the run
    assert policy.cut([r], [4], [[0.05] * 4], None, [False]) == [0]  # none pays for its verify
    assert policy.cut([r], [4], [[nan] * 4], [True], [False]) == [4]  # a copy's drafts: verified whole
    assert policy.cut([r], [4], [[0.05, 0.05, nan, nan]], None, [False]) == [4]  # a confidence missing: whole
    assert policy.cut([r, s], [3, 3], [[0.99] * 3, [0.99, 0.05, 0.99]], None, [False, False]) == [3, 1]  # per row
    assert FixedSpecLength(4).cut([r], [4], [[0.05] * 4], None, [False]) == [4]  # pinned: K is K
    policy.cuts = False
    assert policy.cut([r], [4], [[0.05] * 4], None, [False]) == [4]
    policy.cuts = True
    assert policy.cut([r], [4], [[0.05] * 4], None, [True]) == [4]  # drawn drafts: all (a cut by q(t) is lossy)
    # the target judges: greedy drafts of confidence 0.95 keep failing -> they are cut
    for _ in range(100):
        policy.cut([r], [4], [[0.95] * 4], None, [False])
        policy.observe(r, 4, 0)
    assert policy.draft_calibrations[False](0.95) < 0.1
    assert policy.cut([r], [4], [[0.95] * 4], None, [False]) == [0]
    # a row whose verified drafts were all accepted: its estimate counts the cut ones at their chances (drafts as
    # drafted price K in choose), not as accepted, nor as never drafted
    p = GoodputSpecLength(8, costs)
    a, b = _req([5]), _req([6])
    for _ in range(20):
        p.cut([a], [4], [[0.99, 0.05, 0.05, 0.05]], None, [False])  # -> 1 verified
        p.observe(a, 1, 1)
        p.observe(b, 1, 1)  # the same round without a cut (or drafting one)
    assert p.alpha(a) < 0.6 < 0.9 < p.alpha(b)  # a: ~1 + 0.05 accepted of ~2.05 judged a round


def test_the_cut_reads_the_prices_its_rounds_choose_read():
    """The cut reads the prices choose read for its round (the cost model is not refreshed between the two), and the
    same answers come from prices read afresh: with the round's sheet, without one (no choose), and after the
    forward's refresh (``timed`` drops the sheet)."""
    costs = CostModel.from_points(2, 8, {(1, 1): 1.0, (1, 9): 2.6, (2, 1): 1.0, (2, 9): 4.2}, {1: 0.1, 2: 0.1})
    confs = [[[0.99] * 4], [[0.99, 0.99, 0.05, 0.99]], [[0.05] * 4], [[0.9, 0.8, 0.7, 0.6]]]
    for conf in confs:
        fresh = GoodputSpecLength(8, costs)
        r = _req([1, 2])
        want = fresh.cut([r], [4], conf, None, [False])
        policy = GoodputSpecLength(8, costs)
        policy.choose([r], [8])
        assert policy.sheet is not None and policy.sheet.B == 1
        assert policy.cut([r], [4], conf, None, [False]) == want and policy.sheet is None  # read once
        policy.choose([r], [8])
        policy.timed(1, 2.0, 1.5)  # a forward: the prices move on, the sheet goes
        assert policy.sheet is None
    # the two-row sheet prices the rows that drafted, whatever choose priced
    policy, fresh = GoodputSpecLength(8, costs), GoodputSpecLength(8, costs)
    r, s = _req([1, 2]), _req([3, 4])
    want = fresh.cut([r, s], [3, 3], [[0.99] * 3, [0.99, 0.05, 0.99]], None, [False, False])
    policy.choose([r, s], [8, 8])
    assert policy.cut([r, s], [3, 3], [[0.99] * 3, [0.99, 0.05, 0.99]], None, [False, False]) == want == [3, 1]


def test_a_drawer_keeps_a_whole_rounds_tensors_and_copies_a_partial_ones():
    """DraftDrawer.put of a whole round (every row, every position, one call: a lone row's C++ round) keeps the
    call's drafts and takes a greedy round's confidences as its q's largest; a round put in parts writes them into
    the drawer's own tensors. The proposal is the same either way."""
    import torch

    from infer.proposers.base import DraftBatch, DraftDrawer

    V, K = 32, 3
    ids = torch.tensor([2, 5, 9, 20, 31])

    dv = SimpleNamespace(ids=ids)  # a draft vocabulary: what DraftDrawer reads of one
    q = torch.softmax(torch.randn(1, K, len(ids)), -1)
    drafts = ids[torch.tensor([[0, 3, 4]])]
    batch = DraftBatch([_req([1, 2])], [K], None, None, [None], V, torch.device("cpu"), confidence=True)
    whole = DraftDrawer(batch, None, dv)
    whole.put(0, [0], drafts, q)
    a = whole.proposal([K])
    assert a.drafts is drafts and torch.equal(a.confidence, q.amax(-1))
    parts = DraftDrawer(batch, None, dv)
    parts.put(0, [0], drafts[:, :2], q[:, :2])
    parts.put(2, [0], drafts[:, 2:], q[:, 2:])
    b = parts.proposal([K])
    assert b.drafts is not drafts and torch.equal(b.drafts, a.drafts) and torch.equal(b.confidence, a.confidence)
    none = DraftDrawer(DraftBatch([_req([1, 2])], [K], None, None, [None], V, torch.device("cpu")), None, dv)
    none.put(0, [0], drafts, q)
    assert none.proposal([K]).confidence is None  # not asked for
    empty = DraftDrawer(batch, None, dv).proposal([0])  # nothing drawn: zeros, NaN confidences
    assert not empty.drafts.any() and empty.confidence.isnan().all()


def test_feature_store_reads_are_copies():
    """FeatureStore.get returns the rows and columns read as a fresh tensor, whether every row is stored (one copy)
    or some are not (zeros there): writing into it leaves the store as it was."""
    import torch

    from infer.proposers.features import FeatureStore

    store = FeatureStore(slice(2, None))
    r = _req([1, 2, 3])
    h = torch.arange(24, dtype=torch.float32).view(4, 6)
    store.add(r, 0, h[:2])
    store.add(r, 2, h[2:])
    got = store.get(r, 1, 4, 4, torch.bfloat16, torch.device("cpu"))
    assert got.is_contiguous() and got.dtype == torch.bfloat16 and torch.equal(got, h[1:4, 2:].bfloat16())
    got.fill_(-1)
    assert torch.equal(store.get(r, 0, 4, 4, torch.float32, torch.device("cpu")), h[:, 2:])
    part = store.get(r, 2, 6, 4, torch.float32, torch.device("cpu"))  # past the stored rows: zeros
    assert torch.equal(part[:2], h[2:, 2:]) and not part[2:].any()


def test_hybrid_drafts_copies_when_its_model_is_priced_out(gqa_dir):
    """Through the engine: the hybrid's model steps priced at 1000 s, n-gram copies still drafted and accepted, the
    output the plain one."""
    params = SamplingParams(temperature=0, max_tokens=60)
    plain = LLM(gqa_dir).generate([[0, 5, 6]], params)[0]
    eng = Engine(EngineConfig(model=gqa_dir, draft_model=gqa_dir, proposer="hybrid", prompt_lookup_min=1))
    policy = eng.decoder.spec_length
    # set, not profiled (a profile taken on a busy machine could price even free drafts out): verifies cheap
    policy.costs = CostModel.from_points(policy.costs.max_batch, policy.costs.k_max,
                                         {(1, 1): 1.0, (1, policy.costs.k_max + 1): 1.2}, {1: 1000.0})
    out = eng.run([eng.add_request([0, 5, 6], params)])[0]
    assert out.output_ids == plain.token_ids and out.num_accepted_tokens > 0


class _FixedModel:
    """A model proposer stand-in: drafts [9, 8, ...] for each row asked, with a q of its own (or None)."""

    uses_draft_model = uses_features = False

    def __init__(self, with_q: bool):
        self.with_q, self.asked = with_q, []

    def propose(self, batch):
        import torch

        from infer.proposers.base import Proposal
        self.asked.append([r.prompt_ids for r in batch.reqs])
        K, V = batch.K, batch.vocab_size
        drafts = torch.tensor([[9, 8, 7, 6][:K]] * len(batch.reqs))
        q = torch.softmax(torch.randn(len(batch.reqs), K, V), -1) if self.with_q else None
        return Proposal(drafts, list(batch.ks), q)


@pytest.mark.parametrize("with_q", [True, False])
def test_hybrid_q_is_one_hot_on_copies_and_the_models_elsewhere(with_q):
    """At a temperature the hybrid hands verification q only where it needs one: none where every draft is a copy
    or deterministic (verify's rule for q = None, the same law as a one-hot q), the model's own where every row is
    the model's, and for rows of both kinds one q with one-hot rows on the copies and the model's rows as drawn."""
    import torch

    from infer.proposers.base import DraftBatch
    from infer.proposers.ngram import HybridProposer
    from infer.sampling import SamplingBatch

    V = 32
    copying, fresh = _req([1, 2, 3, 1, 2]), _req([4, 5, 6])  # (1, 2) repeats: prompt lookup drafts 3, 1, 2
    hyb = HybridProposer(NgramProposer(1, 3), model := _FixedModel(with_q))

    def batch(reqs, ks):
        sb = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * len(reqs), V, "cpu")
        return DraftBatch(reqs, ks, sb, None, [torch.Generator()] * len(reqs), V, torch.device("cpu"))

    only_copies = hyb.propose(batch([copying], [3]))
    assert only_copies.drafts[0].tolist() == [3, 1, 2] and only_copies.q is None and model.asked == []
    only_model = hyb.propose(batch([fresh], [3]))
    assert only_model.drafts[0].tolist() == [9, 8, 7] and only_model.free == [False]
    assert (only_model.q is None) == (not with_q)
    both = hyb.propose(batch([copying, fresh], [3, 3]))
    assert both.drafts.tolist() == [[3, 1, 2], [9, 8, 7]] and both.num_draft == [3, 3]
    if with_q:
        assert torch.equal(both.q[0], torch.nn.functional.one_hot(torch.tensor([3, 1, 2]), V).float())
        assert torch.allclose(both.q[1].sum(-1), torch.ones(3)) and (both.q[1] < 1).all()  # the model's q
    else:
        assert both.q is None


def test_q_over_a_draft_vocabulary_is_built_only_when_read():
    """A compiled round's drafts of every row keep q over the draft vocabulary (DraftDrawer.put -> Proposal.q_sub):
    the sampled verify reads it there (q_over_draft_vocab), and anyone reading ``q`` gets it scattered into
    [B, K, V], 0 outside the ids; the hybrid passes it on as it is where every row is the model's, and builds one
    q where rows of both kinds meet. Rows put apart, or a position drawn step by step, use the full q from the start."""
    import torch

    from infer.proposers.base import DraftBatch, DraftDrawer, Proposal
    from infer.proposers.ngram import HybridProposer
    from infer.sampling import SamplingBatch

    V, K = 32, 3
    ids = torch.tensor([2, 5, 9, 20, 31])

    dv = SimpleNamespace(ids=ids)  # a draft vocabulary: what DraftDrawer reads of one

    def batch(reqs, ks):
        sb = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * len(reqs), V, "cpu")
        return DraftBatch(reqs, ks, sb, None, [torch.Generator()] * len(reqs), V, torch.device("cpu"))

    def scattered(q_sub):
        return torch.zeros(q_sub.shape[0], K, V).scatter_(2, ids.expand(*q_sub.shape), q_sub)

    q_sub = torch.softmax(torch.randn(1, K, len(ids)), -1)
    drawer = DraftDrawer(batch([_req([1, 2])], [K]), None, dv)
    drawer.put(0, [0], ids[torch.tensor([[0, 3, 4]])], q_sub)
    prop = drawer.proposal([K])
    assert prop.has_q and prop.q_over_draft_vocab()[0] is q_sub and prop.q_over_draft_vocab()[1] is ids
    assert torch.equal(prop.q, scattered(q_sub))  # built when read ...
    assert prop.q_over_draft_vocab() is None and prop.q is prop.q  # ... once
    split = DraftDrawer(batch([_req([1, 2])], [K]), None, dv)  # a round's first steps, then a chain
    split.put(0, [0], ids[torch.tensor([[0, 3]])], q_sub[:, :2])
    split.put(2, [0], ids[torch.tensor([[4]])], q_sub[:, 2:])
    assert torch.equal(split.proposal([K]).q_over_draft_vocab()[0], q_sub)
    rows = DraftDrawer(batch([_req([1, 2]), _req([3])], [K, K]), None, dv)  # one row of two put: the full q
    rows.put(0, [1], ids[torch.tensor([[0, 3, 4]])], q_sub)
    two = rows.proposal([0, K])
    assert two.q_over_draft_vocab() is None and torch.equal(two.q[1], scattered(q_sub)[0]) and not two.q[0].any()

    class _SubModel(_FixedModel):
        def propose(self, batch):
            out = Proposal(torch.tensor([[2, 9, 31]] * len(batch.reqs)), list(batch.ks))
            out.q_sub, out.vocab_size = (q_sub.expand(len(batch.reqs), K, len(ids)).contiguous(), ids), V
            return out

    hyb = HybridProposer(NgramProposer(1, 3), _SubModel(True))
    copying, fresh = _req([1, 2, 3, 1, 2]), _req([4, 5, 6])
    only_model = hyb.propose(batch([fresh], [K]))
    assert torch.equal(only_model.q_over_draft_vocab()[0], q_sub) and torch.equal(only_model.q, scattered(q_sub))
    both = hyb.propose(batch([copying, fresh], [K, K]))
    assert both.q_over_draft_vocab() is None
    assert torch.equal(both.q[0], torch.nn.functional.one_hot(torch.tensor([3, 1, 2]), V).float())
    assert torch.equal(both.q[1], scattered(q_sub)[0])
