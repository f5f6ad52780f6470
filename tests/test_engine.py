"""The serving engine (issue 5, D10): batched greedy parity with one-at-a-time decoding across both KV backends,
prefix caching, chunked prefill and speculation; seeded reproducibility in any batch; multi-token steps;
preemption under pool exhaustion; abort; config validation and bad input."""

import random

import pytest
import torch

from infer.engine import Engine, EngineConfig, QueueFullError
from infer.generate import autoregressive_generate
from infer.sampling import SamplingParams
from infer.testing import make_tiny_llama
from infer.tokenizer import Tokenizer


def _prompts(n=12, seed=0):
    rnd = random.Random(seed)
    shared = [rnd.randrange(5, 300) for _ in range(13)]  # half the prompts share a 13-token prefix
    prompts, max_tokens = [], []
    for i in range(n):
        tail = [rnd.randrange(5, 300) for _ in range(rnd.randrange(1, 30))]
        prompts.append(shared + tail if i % 2 else tail)
        max_tokens.append(rnd.randrange(1, 30))
    return prompts, max_tokens


def _engine(models, gqa_dir, spec=True, draft=None, **kw):
    target, drafter, tok = models
    cfg = EngineConfig(model=gqa_dir, draft_model=gqa_dir if spec else None, **kw)
    return Engine(cfg, model=target, draft_model=(draft or drafter) if spec else None, tokenizer=tok)


@pytest.fixture(scope="module")
def reference(models):
    target, _, tok = models
    prompts, max_tokens = _prompts()
    return [autoregressive_generate(target, p, SamplingParams(temperature=0, max_tokens=m), tok.eos_token_ids).output_ids
            for p, m in zip(prompts, max_tokens)]


CONFIGS = {
    "contiguous": dict(kv_cache_backend="contiguous"),
    "paged": dict(kv_cache_backend="paged", block_size=4),
    "paged+prefix": dict(kv_cache_backend="paged", block_size=4, enable_prefix_caching=True),
}


@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_equals_one_at_a_time(models, gqa_dir, reference, name, spec):
    eng = _engine(models, gqa_dir, spec, max_batch_size=4, max_num_batched_tokens=24, spec_length=3,
                  **CONFIGS[name])
    prompts, max_tokens = _prompts()
    reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    eng.run(reqs)
    assert [r.output_ids for r in reqs] == reference
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens  # nothing leaked
    if spec:
        assert 0 < eng.stats.acceptance_rate < 1  # real accepts and real rejections
        assert eng.stats.num_draft_tokens == sum(r.num_draft_tokens for r in reqs)
        assert sum(eng.stats.accepted_per_position) == eng.stats.num_accepted_tokens
    if "prefix" in name:
        assert eng.stats.prefix_cache_hit_tokens > 0
        if spec:  # the draft model's cache took its blocks over the same prefixes (kv_manager)
            assert eng.kv.draft_pool.prefix_hits > 0


@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_a_next_turn_finds_the_last_answers_blocks(models, gqa_dir, spec):
    """A finished request's computed blocks, its output's included, stay in the prefix cache (vLLM's): a next turn
    that repeats prompt and answer computes only what is new, in both pools, and its tokens are the target's. The
    prefix cache is on by default (paged backend) and off where asked, or with the contiguous backend."""
    target = models[0]
    assert EngineConfig(model="m").enable_prefix_caching
    assert not EngineConfig(model="m", kv_cache_backend="contiguous").enable_prefix_caching
    assert not EngineConfig(model="m", enable_prefix_caching=False).enable_prefix_caching
    eng = _engine(models, gqa_dir, spec, block_size=4, spec_length=3)
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    first = eng.run([eng.add_request(list(range(5, 18)), params)])[0]
    turn = first.prompt_ids + first.output_ids + [40, 41, 42]
    nxt = eng.run([eng.add_request(turn, params)])[0]
    computed = len(first.prompt_ids) + len(first.output_ids) - 1  # its last token was never fed
    assert nxt.num_cached_tokens == computed // 4 * 4 > len(first.prompt_ids)
    assert nxt.output_ids == autoregressive_generate(target, turn, params).output_ids
    if spec:
        assert eng.kv.draft_pool.prefix_hits >= computed // 4 * 4
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_self_drafting_accepts_everything_and_emits_several_tokens_per_step(models, gqa_dir):
    target = models[0]
    eng = _engine(models, gqa_dir, draft=target, spec_length=4)
    req = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    per_step = []
    while not req.finished:
        per_step.append(len([o for o in eng.step() if o.request_id == req.request_id]))
    assert max(per_step) == 5  # K accepted + bonus in one step
    final = req.output_ids
    assert len(final) == 11 and req.acceptance_rate == 1.0
    # the last StepOutput carries the acceptance rate
    eng2 = _engine(models, gqa_dir, draft=target, spec_length=4)
    eng2.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    outs = [o for _ in range(20) for o in eng2.step()]
    assert outs[-1].finished and outs[-1].acceptance_rate == 1.0 and outs[-1].num_draft_tokens > 0
    assert all(o.acceptance_rate is None for o in outs[:-1])


@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_seeded_request_is_the_same_alone_or_in_any_batch(models, gqa_dir, spec):
    params = SamplingParams(temperature=1.0, top_k=40, max_tokens=20, seed=7, ignore_eos=True)
    eng = _engine(models, gqa_dir, spec, max_batch_size=4, block_size=4, spec_length=3)
    alone = eng.run([eng.add_request([10, 11, 12], params)])[0].output_ids
    for others in (3, 6):
        prompts, max_tokens = _prompts(others, seed=others)
        reqs = [eng.add_request(p, SamplingParams(temperature=0.9, max_tokens=m)) for p, m in zip(prompts, max_tokens)]
        mine = eng.add_request([10, 11, 12], params)
        eng.run(reqs + [mine])
        assert mine.output_ids == alone


@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_a_seeded_request_is_the_same_whatever_the_prefix_cache_held(models, gqa_dir, spec):
    """A prompt of 5 tokens whose first 4 are cached decodes at once (nothing left to prefill): its first token is
    still drawn by a plain step, as the prefill draws it where nothing was cached (Request.plain_next), so the
    seeded request's tokens do not depend on the cache; a drafted first step drew others (speculation stays exact in
    law either way, but a seed must reproduce)."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=11, ignore_eos=True)
    eng = _engine(models, gqa_dir, spec, block_size=4, spec_length=3)
    first = eng.run([eng.add_request([7, 8, 9, 10, 11], params)])[0]
    again = eng.run([eng.add_request([7, 8, 9, 10, 11], params)])[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 4)
    assert again.output_ids == first.output_ids


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_pool_exhaustion_preempts_and_every_request_completes(models, gqa_dir, backend):
    target, _, tok = models
    kw = dict(num_kv_blocks=14, block_size=4) if backend == "paged" else dict(max_seq_len=60)
    eng = _engine(models, gqa_dir, kv_cache_backend=backend, max_batch_size=6, spec_length=3, **kw)
    rnd = random.Random(1)
    prompts = [[rnd.randrange(5, 300) for _ in range(rnd.randrange(5, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.run(reqs)
    ref = [autoregressive_generate(target, p, params).output_ids for p in prompts]
    assert [r.output_ids for r in reqs] == ref
    # preempted or not, each request's clock reads arrival <= first token <= finish
    assert all(r.arrival_time <= r.first_token_time <= r.finish_time for r in reqs)
    if backend == "paged":
        assert eng.stats.num_preemptions > 0  # 14 blocks cannot hold six 50-token sequences
    assert eng.free_kv_tokens() == eng.initial_free_kv_tokens


def test_abort_at_any_time_frees_everything(models, gqa_dir):
    eng = _engine(models, gqa_dir, max_batch_size=2, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = [eng.add_request(list(range(5, 5 + n)), params) for n in (20, 3, 9, 4)]
    eng.step()  # first request mid-prefill (chunked), others waiting
    out = eng.abort(reqs[0].request_id)
    assert out.finished and out.finish_reason == "abort" and reqs[0].finish_reason == "abort"
    for _ in range(4):
        eng.step()  # two decoding now, one still waiting
    assert eng.num_running == 2 and eng.num_waiting == 1
    for r in reqs[1:]:
        eng.abort(r.request_id)
    assert eng.abort(reqs[1].request_id) is None  # unknown / already finished: nothing to do
    assert not eng.has_unfinished and eng.free_kv_tokens() == eng.initial_free_kv_tokens
    assert eng.stats.requests_finished["abort"] == 4


def test_overflow_guard_near_max_seq_len(models, gqa_dir, reference):
    target = models[0]
    eng = _engine(models, gqa_dir, draft=target, spec_length=5, max_seq_len=24, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    req = eng.run([eng.add_request(list(range(5, 15)), params)])[0]  # 10 + 14 = max_seq_len exactly
    assert req.output_ids == autoregressive_generate(target, list(range(5, 15)), params).output_ids


def test_stop_strings_and_penalty_through_the_engine(models, gqa_dir):
    target, _, tok = models
    prompts, _ = _prompts(6, seed=3)
    ref_params = SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.3, ignore_eos=True)
    ref = [autoregressive_generate(target, p, ref_params, tokenizer=tok) for p in prompts]
    stops = [r.text[3:5] for r in ref if len(r.text) > 6][:2]  # strings that occur in the outputs
    params = SamplingParams(temperature=0, max_tokens=25, repetition_penalty=1.3, ignore_eos=True, stop=stops)
    expect = [autoregressive_generate(target, p, params, tokenizer=tok) for p in prompts]
    eng = _engine(models, gqa_dir, max_batch_size=3, spec_length=3)
    got = eng.run([eng.add_request(p, params) for p in prompts])
    assert [(r.output_ids, r.text, r.finish_reason) for r in got] == [
        (r.output_ids, r.text, r.finish_reason) for r in expect]
    assert any(r.finish_reason == "stop" for r in got)


def test_config_validation():
    assert EngineConfig(model="m", use_speculative_decoding=True).proposer == "ngram"  # no drafter: prompt lookup
    with pytest.raises(ValueError, match="needs a draft_model"):
        EngineConfig(model="m", use_speculative_decoding=True, proposer="hybrid")
    with pytest.raises(ValueError, match="proposer must be one of"):
        EngineConfig(model="m", draft_model="d", proposer="medusa")
    with pytest.raises(ValueError, match="acceptance must be one of"):
        EngineConfig(model="m", draft_model="d", acceptance="loose")
    with pytest.raises(ValueError, match="lenience"):
        EngineConfig(model="m", draft_model="d", acceptance="lenient", lenience=0.0)
    with pytest.raises(ValueError, match="spec_length must be"):
        EngineConfig(model="m", draft_model="d", spec_length="fast")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(model="m", use_speculative_decoding=True, prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="spec_length"):
        EngineConfig(model="m", draft_model="d", spec_length=0)
    with pytest.raises(ValueError, match="kv_cache_backend"):
        EngineConfig(model="m", kv_cache_backend="ring")
    with pytest.raises(ValueError, match="prefix"):
        EngineConfig(model="m", kv_cache_backend="contiguous", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(model="m", max_batch_size=0)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", num_kv_blocks=4, kv_cache_memory_mb=1.0)
    with pytest.raises(ValueError, match="spec_length_min"):
        EngineConfig(model="m", draft_model="d", spec_length="egag", spec_length_min=4, spec_length_max=2)
    assert EngineConfig(model="m", draft_model="d").use_speculative_decoding  # a drafter turns speculation on
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        EngineConfig(model="m", device="gpu")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(model="m", device="mps")
    if not torch.cuda.is_available():  # the GPU's absence said before any loading, not torch's assertion
        with pytest.raises(ValueError, match="CUDA is not available here"):
            EngineConfig(model="m", device="cuda")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            EngineConfig(model="m", device=f"cuda:{torch.cuda.device_count()}")


def test_drafter_with_another_vocabulary_is_refused(gqa_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "wide", "gqa", vocab_size=400)
    with pytest.raises(ValueError, match="vocab"):
        Engine(EngineConfig(model=gqa_dir, draft_model=other))


def test_bad_requests_are_refused_before_queueing(models, gqa_dir):
    eng = _engine(models, gqa_dir, num_kv_blocks=4, block_size=4, max_waiting_requests=1)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([1, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="num_kv_blocks"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=10))  # 16-token pool
    eng.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        eng.add_request([1, 2], SamplingParams(max_tokens=2))
    assert eng.num_waiting == 1


@pytest.mark.parametrize("kind", ["q4_1", None])
def test_a_prompts_prefill_does_not_depend_on_the_prompts_beside_it(kind):
    """A prompt prefilled beside a longer one (the same step) gets the same cache and first-token logits, bit for bit, as
    alone: plain and speculating engines, whose requests finish at other steps, prefill a prompt with other neighbours.
    (One forward a request: a padded row took attention's masked path, an ulp off the causal one, and a quantized
    target's int8 activations carry an ulp to ~2% of its states: docs/design.md, numerics.)"""
    from infer.model.quant import quantize_model
    from infer.testing import random_llama

    model = random_llama(64, seed=0, hidden_size=64)
    if kind:
        model = quantize_model(model, kind)
    prompt, longer = [(5 * j) % 61 + 1 for j in range(23)], [(7 * j) % 59 + 2 for j in range(37)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def first_token(prompts):
        eng = Engine(EngineConfig(model="t", block_size=4, quantization=kind), model=model)
        reqs = [eng.add_request(p, params) for p in prompts]
        outs = eng.step()  # every prompt prefilled in this one step, and its first token drawn
        assert all(len(r.output_ids) == 1 for r in reqs)
        return next(o.top_logprobs for o in outs if o.request_id == reqs[0].request_id)

    assert first_token([prompt]) == first_token([prompt, longer])  # exact floats


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_prompt_logprobs_are_the_targets_over_chunks_prefix_hits_and_speculation(models, backend):
    """SamplingParams.prompt_logprobs: log p of each prompt token after the first given those before it (the
    target's raw law, as the output's logprobs) and its top alternatives, whatever the prefill chunks (a prompt split
    over steps), a cached prefix (a scored prompt is computed whole: the cache holds no states to score by) and a
    drafter beside it. Checked against one forward over the whole prompt."""
    target, drafter, _ = models
    prompt = [(11 * j) % 250 + 3 for j in range(29)]
    with torch.no_grad():
        logp = target.compute_logits(target(torch.tensor([prompt])))[0].float().log_softmax(-1)  # [T, V]
    expect = logp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    top = logp[:-1].topk(3, -1)
    caching = {"enable_prefix_caching": True} if backend == "paged" else {}
    for draft in (None, drafter):
        spec = {"spec_length": 3, "draft_model": "drafter"} if draft is not None else {}
        eng = Engine(EngineConfig(model="t", kv_cache_backend=backend, block_size=4, max_num_batched_tokens=8,
                                  **spec, **caching), model=target, draft_model=draft)
        plain = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))  # fills the prefix cache
        while eng.has_unfinished:
            eng.step()
        scored = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3))
        first = []
        while eng.has_unfinished:
            first += [o for o in eng.step() if o.request_id == scored.request_id]
        assert scored.output_ids == plain.output_ids
        assert (eng.stats.num_drafts > 0) == (draft is not None)
        got = first[0].prompt_logprobs
        assert got == scored.prompt_logprobs and all(o.prompt_logprobs is None for o in first[1:])
        assert got[0] is None and len(got) == len(prompt)
        assert [g[0] for g in got[1:]] == pytest.approx(expect.tolist(), abs=1e-4)
        assert [[t for t, _ in g[1]] for g in got[1:]] == top.indices.tolist()
        assert [v for g in got[1:] for _, v in g[1]] == pytest.approx(top.values.flatten().tolist(), abs=1e-4)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_min_tokens_holds_every_stop_back_and_speculation_keeps_greedy_parity(models, backend):
    """min_tokens (vLLM's): no stop token (EOS, stop_token_ids) ends a request before its min_tokens-th token; the
    plain engine's greedy output there is its argmax with the stops masked, and the speculating engine's the same
    (its rounds verify under the same mask, position by position); past the minimum the stop ends it as usual."""
    target, drafter, _ = models
    prompt = [(7 * j) % 200 + 5 for j in range(11)]
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    plain = Engine(EngineConfig(model="t", kv_cache_backend=backend, block_size=4), model=target)
    spec = Engine(EngineConfig(model="t", draft_model="drafter", kv_cache_backend=backend, block_size=4,
                               spec_length=3), model=target, draft_model=drafter)
    free = plain.run([plain.add_request(prompt, SamplingParams(**greedy))])[0].output_ids
    stop = free[1]  # the greedy run's second token as a stop token: without min_tokens the output ends there
    early = plain.run([plain.add_request(prompt, SamplingParams(**greedy, stop_token_ids=[stop]))])[0]
    assert early.output_ids == free[:free.index(stop) + 1] and early.finish_reason == "stop"
    params = SamplingParams(**greedy, stop_token_ids=[stop], min_tokens=6)
    held = plain.run([plain.add_request(prompt, params)])[0]
    assert len(held.output_ids) >= 6 and stop not in held.output_ids[:6]
    assert held.output_ids[1] != stop  # the masked argmax: another token
    assert spec.run([spec.add_request(prompt, params)])[0].output_ids == held.output_ids
    assert spec.stats.num_drafts > 0


def test_truncate_prompt_tokens_reads_the_prompt_end(models):
    """truncate_prompt_tokens (vLLM's): the engine (and autoregressive_generate) read the prompt's last k tokens, as if
    only those were given; -1 keeps as many as max_seq_len; k must be >= 1 or -1."""
    target, _, _ = models
    prompt = [(5 * j) % 200 + 3 for j in range(20)]
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    eng = Engine(EngineConfig(model="t", max_seq_len=64), model=target)
    short = eng.run([eng.add_request(prompt[-7:], SamplingParams(**greedy))])[0]
    cut = eng.run([eng.add_request(prompt, SamplingParams(**greedy, truncate_prompt_tokens=7))])[0]
    assert cut.prompt_ids == prompt[-7:] and cut.output_ids == short.output_ids
    assert autoregressive_generate(target, prompt, SamplingParams(**greedy, truncate_prompt_tokens=7),
                                   eos_token_ids=[]).output_ids == short.output_ids
    whole = eng.run([eng.add_request(prompt, SamplingParams(**greedy, truncate_prompt_tokens=-1))])[0]
    assert whole.prompt_ids == prompt
    with pytest.raises(ValueError, match="exceeds"):  # -1 keeps 64: with max_tokens it cannot fit
        eng.add_request(list(range(3, 83)), SamplingParams(**greedy, truncate_prompt_tokens=-1))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_min_tokens_holds_stop_strings_back():
    """A stop string seen before min_tokens does not end the request (vLLM checks them from the minimum on)."""
    from infer.request import Request

    tok = Tokenizer(str(__import__("infer.demo", fromlist=["demo_model_paths"]).demo_model_paths()[0]))
    ids = tok.encode("a = 1\nb = 2\nc = 3\nd = 4")
    for min_tokens, ends_after in ((0, "a = 1"), (len(tok.encode("a = 1\nb")), "b = 2")):
        r = Request([1], SamplingParams(stop=["\n"], min_tokens=min_tokens, max_tokens=len(ids)), tokenizer=tok)
        for t in ids:
            if r.append(t):
                break
        assert r.finish_reason == "stop" and r.text.endswith(ends_after), (min_tokens, r.text)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_priority_policy_admits_by_priority_then_arrival_and_preempts_the_lowest(models, gqa_dir):
    """vLLM's scheduling_policy "priority": the waiting queue runs lower priority values first (arrival breaks ties),
    and where KV runs short the running request of the lowest priority is preempted, not the newest (as "fcfs"
    does); the tokens are every request's own either way. "fcfs" refuses a priority it would ignore."""
    target, _, tok = models
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = _engine(models, gqa_dir, spec=False, scheduling_policy="priority", max_batch_size=1)
    prompts = [[5 + i, 9, 13] for i in range(5)]
    reqs = [eng.add_request(p, params, priority=rank) for p, rank in zip(prompts, (3, 0, 2, 0, -1))]
    done = []
    while eng.has_unfinished:
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == [reqs[i].request_id for i in (4, 1, 3, 2, 0)]
    assert [r.output_ids for r in reqs] == [autoregressive_generate(target, p, params).output_ids for p in prompts]

    # the first request decodes alone, then six more arrive: 14 blocks of 4 cannot hold them all
    rnd = random.Random(1)
    prompts = [[rnd.randrange(5, 300) for _ in range(rnd.randrange(5, 20))] for _ in range(7)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [autoregressive_generate(target, p, params).output_ids for p in prompts]
    for policy, low in (("fcfs", 0), ("priority", 5)):
        eng = _engine(models, gqa_dir, scheduling_policy=policy, max_batch_size=6, num_kv_blocks=14, spec_length=3,
                      block_size=4)
        first = eng.add_request(prompts[0], params, priority=low)
        for _ in range(3):
            eng.step()
        reqs = [first] + [eng.add_request(p, params) for p in prompts[1:]]
        eng.run(reqs)
        assert [r.output_ids for r in reqs] == ref and eng.stats.num_preemptions > 0
        assert (first.num_preemptions > 0) == (policy == "priority"), policy  # fcfs preempts the newest
        assert eng.free_kv_tokens() == eng.initial_free_kv_tokens
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        _engine(models, gqa_dir, spec=False).add_request([5, 6], params, priority=1)
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        EngineConfig(model=gqa_dir, scheduling_policy="lifo")
