"""Generation loops: greedy parity with transformers, seeded sampling, stop conditions, beam search, bad input."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from infer import LLM, SamplingParams
from infer.generate import autoregressive_generate, beam_search_generate
from infer.model import load_model
from infer.request import Request

PROMPTS = ["def fib", "The quick brown fox", "Hello world", "import os\nimport sys\n", "x", "Café 你好"]


@pytest.mark.parametrize("shape", ["gqa", "llama3", "tied"])
def test_greedy_matches_transformers(ckpt_dirs, hf_model, shape):
    path = ckpt_dirs[shape]
    llm, ref, tok = LLM(path), hf_model(path), AutoTokenizer.from_pretrained(path)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        assert out.token_ids == expected[: len(out.token_ids)]
        # HF pads after EOS; we stop at it: the lengths agree up to that
        assert out.finish_reason == ("length" if len(out.token_ids) == 24 else "stop")


def test_seeded_sampling_is_reproducible(gqa_dir):
    llm = LLM(gqa_dir)
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=123)
    a = llm.generate(PROMPTS[:3], p)
    b = llm.generate(PROMPTS[:3][::-1], p)[::-1]  # other order, other neighbours: same tokens per request
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = llm.generate(PROMPTS[:3], SamplingParams(temperature=1.0, max_tokens=20, seed=124))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_first_token_distribution_matches_target(gqa_dir):
    """Sampled first tokens follow softmax(logits / T) restricted by top-k (chi-square)."""
    from scipy.stats import chisquare

    m = load_model(gqa_dir)
    prompt = [0, 5, 9, 12]
    with torch.no_grad():
        logits = m.compute_logits(m(torch.tensor([prompt])))[0, -1]
    k = 5
    top = logits.topk(k)
    expected = (top.values / 0.8).softmax(-1)
    n = 1500
    counts = torch.zeros(k)
    params = SamplingParams(temperature=0.8, top_k=k, max_tokens=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        t = autoregressive_generate(m, prompt, params, [], generator=g).output_ids[0]
        assert t in top.indices.tolist()
        counts[top.indices.tolist().index(t)] += 1
    assert chisquare(counts.numpy(), (expected * n).numpy()).pvalue > 0.001


def _greedy(m, prompt, n=20, **kw):
    return autoregressive_generate(m, prompt, SamplingParams(temperature=0, max_tokens=n, **kw), [])


def test_eos_list_stops_exactly_there(gqa_dir):
    m = load_model(gqa_dir)
    prompt = [0, 40, 41, 42]
    full = _greedy(m, prompt).output_ids
    stop_at = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # first occurrence of a new token
    out = autoregressive_generate(m, prompt, SamplingParams(temperature=0, max_tokens=20), [999, full[stop_at]])
    assert out.output_ids == full[: stop_at + 1] and out.finish_reason == "stop"
    assert out.stop_reason == full[stop_at]
    ignored = autoregressive_generate(m, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                      [full[stop_at]])
    assert ignored.output_ids == full and ignored.finish_reason == "length"


def test_stop_token_ids(gqa_dir):
    m = load_model(gqa_dir)
    prompt = [0, 40, 41, 42]
    full = _greedy(m, prompt).output_ids
    i = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    out = _greedy(m, prompt, stop_token_ids=[full[i]])
    assert out.output_ids == full[: i + 1] and out.finish_reason == "stop"


def test_stop_string_ends_output_before_it(gqa_dir):
    llm = LLM(gqa_dir)
    full = llm.generate(["def fib"], SamplingParams(temperature=0, max_tokens=30))[0]
    text = full.text
    assert len(text) >= 10
    stop = text[6:9]
    out = llm.generate(["def fib"], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    # the last token completed the stop string: without it the string is not there yet
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_max_tokens_is_never_exceeded(gqa_dir):
    llm = LLM(gqa_dir)
    for n in (1, 2, 7):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=n, seed=1, ignore_eos=True))
        assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in outs)


def test_request_timestamps(gqa_dir):
    """The library loops stamp time to first token and finish as the engine does (benchmarks time decoding by them)."""
    model = load_model(gqa_dir)
    req = autoregressive_generate(model, [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), [])
    assert req.arrival_time <= req.first_token_time < req.finish_time
    fresh = Request([5], SamplingParams(max_tokens=2), [])
    assert fresh.first_token_time is None and fresh.finish_time is None
    fresh.append(9)
    assert fresh.first_token_time is not None and fresh.finish_time is None
    fresh.abort()
    assert fresh.finish_time >= fresh.first_token_time


def test_token_id_prompts_and_per_prompt_params(gqa_dir):
    llm = LLM(gqa_dir)
    ids = llm.tokenizer.encode("def fib")
    a, b = llm.generate([ids, "def fib"], [SamplingParams(temperature=0, max_tokens=5),
                                           SamplingParams(temperature=0, max_tokens=3)])
    assert a.token_ids[:3] == b.token_ids and len(a.token_ids) == 5
    assert a.prompt is None and b.prompt == "def fib" and a.prompt_token_ids == ids


def test_bad_input_is_refused_clearly(gqa_dir):
    llm = LLM(gqa_dir)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        llm.generate(["hi"], SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 99999]])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])
    with pytest.raises(FileNotFoundError):
        LLM("/no/such/model")
    with pytest.raises(ValueError, match="logprobs are reported by the engine"):  # the reference loop computes none
        autoregressive_generate(llm.model, [1, 2], SamplingParams(max_tokens=2, prompt_logprobs=1))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_beam_search_matches_transformers(ckpt_dirs, hf_model, num_beams):
    path = ckpt_dirs["llama3"]
    m, ref, tok = load_model(path), hf_model(path), AutoTokenizer.from_pretrained(path)
    for prompt in PROMPTS[:5]:
        ids = tok(prompt, return_tensors="pt").input_ids
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                num_beams=num_beams, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        best = beam_search_generate(m, ids[0].tolist(), num_beams=num_beams, max_tokens=12)[0]
        assert best.token_ids == expected[: len(best.token_ids)]


def test_beam_search_with_one_beam_is_greedy(gqa_dir):
    m = load_model(gqa_dir)
    prompt = [0, 7, 8]
    assert beam_search_generate(m, prompt, num_beams=1, max_tokens=15, eos_token_ids=[])[0].token_ids == \
        _greedy(m, prompt, 15).output_ids


def test_beam_search_bad_input(gqa_dir):
    m = load_model(gqa_dir)
    with pytest.raises(ValueError, match="num_beams"):
        beam_search_generate(m, [1, 2], num_beams=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        beam_search_generate(m, [1, 2], max_tokens=10_000)


def test_beam_search_matches_transformers_when_beams_finish_early(ckpt_dirs, hf_model):
    """EOS chosen from tokens the beams actually produce, so hypotheses finish at different lengths."""
    path = ckpt_dirs["gqa"]
    m, ref, tok = load_model(path), hf_model(path), AutoTokenizer.from_pretrained(path)
    checked = 0
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        greedy = _greedy(m, ids[0].tolist(), 12).output_ids
        eos = greedy[3]
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                num_beams=3, eos_token_id=[eos], pad_token_id=eos)[0, ids.shape[1]:].tolist()
        best = beam_search_generate(m, ids[0].tolist(), num_beams=3, max_tokens=12, eos_token_ids=[eos])[0]
        assert best.token_ids == expected[: len(best.token_ids)]
        checked += best.token_ids[-1] == eos
    assert checked >= 1, "at least one best hypothesis should end in EOS"


def test_reset_prefix_cache_forgets_what_later_prompts_reuse(gqa_dir):
    llm = LLM(gqa_dir, kv_cache_backend="paged", block_size=4, enable_prefix_caching=True)
    prompt, params = list(range(3, 40)), SamplingParams(temperature=0, max_tokens=6)
    first = llm.generate([prompt], params)[0].token_ids
    assert llm.engine.stats.prefix_cache_hit_tokens == 0
    assert llm.generate([prompt], params)[0].token_ids == first
    hits = llm.engine.stats.prefix_cache_hit_tokens
    assert hits == 36  # the prompt's 9 full blocks (37 tokens, the last one recomputed)
    assert llm.reset_prefix_cache() > 0
    assert llm.generate([prompt], params)[0].token_ids == first
    assert llm.engine.stats.prefix_cache_hit_tokens == hits  # nothing reused after the reset
    assert LLM(gqa_dir).reset_prefix_cache() == 0  # no prefix cache: nothing to forget


def test_chat_takes_one_conversation_or_a_batch_and_names_a_wrong_argument(gqa_dir):
    llm = LLM(gqa_dir)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b = [{"role": "user", "content": "Hello"}], [{"role": "user", "content": "Bye"}]
    one = llm.chat(a, params)
    both = llm.chat([a, b], params)  # vLLM's LLM.chat: a list of conversations, one output each
    assert isinstance(both, list) and both[0].token_ids == one.token_ids
    assert both[1].token_ids == llm.chat(b, params).token_ids
    for bad, says in (("Hello", "got str"), ([], "got an empty list"), ([a, []], "got an empty list"),
                      ([a[0], "x"], "a message of type str"), ({"role": "user"}, "got dict")):
        with pytest.raises(TypeError, match=says):
            llm.chat(bad)
    assert "LLM(" in repr(llm) and "dtype=" in repr(llm)



def test_predictions_are_one_a_prompt_and_change_nothing(gqa_dir):
    """LLM.generate's predictions (OpenAI's predicted outputs): text or ids a prompt, the same outputs; a count that
    does not match the prompts, or ids outside the vocabulary, queue nothing."""
    llm = LLM(gqa_dir, proposer="suffix", spec_length=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(["def f(x):", "import os"], params)
    got = llm.generate(["def f(x):", "import os"], params, predictions=[want[0].text, want[1].token_ids])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].num_accepted_tokens > want[1].num_accepted_tokens  # the ids predicted are the output's own
    for bad, says in (([None], "1 predictions for 2 prompts"), ([None, [1, 10 ** 6]], "prediction token ids")):
        with pytest.raises(ValueError, match=says):
            llm.generate(["def f(x):", "import os"], params, predictions=bad)
    assert not llm.engine.has_unfinished


def test_priorities_order_the_prompts_and_change_no_token(gqa_dir):
    """LLM.generate's priority (vLLM's), one a prompt, on an engine with scheduling_policy "priority" and one slot:
    the prompts finish lowest value first, each with the tokens it has alone, and come back in the prompts' order; a
    priority list of the wrong length or type, or one an "fcfs" engine would ignore, queues nothing."""
    llm = LLM(gqa_dir, scheduling_policy="priority", max_batch_size=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate(PROMPTS[:3], params)
    got = llm.generate(PROMPTS[:3], params, priority=[2, 1, 0])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finished = [o.metrics["finish_time"] for o in got]
    assert finished[2] < finished[1] < finished[0]
    for bad, error, says in (([1], ValueError, "1 priorities for 3 prompts"), (1, TypeError, "list of integers"),
                             ([0, 1.5, 0], ValueError, "integer")):
        with pytest.raises(error, match=says):
            llm.generate(PROMPTS[:3], params, priority=bad)
    fcfs = LLM(gqa_dir)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.generate(PROMPTS[:3], params, priority=[0, 0, 1])
    assert not llm.engine.has_unfinished and not fcfs.engine.has_unfinished


def test_n_sequences_a_prompt_as_vllm_reads_them(gqa_dir):
    """SamplingParams(n=k): k sequences a prompt in ``outputs`` (vLLM's ``out.outputs[j].text``), sequence j drawn
    as the request seeded seed + j would be; the fields are the first's. A sequence of one fills ``outputs`` too."""
    llm = LLM(gqa_dir)
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=7, logprobs=0)
    a, b = llm.generate(["def fib", "Hello"], [replace(p, n=3), p])
    assert [o.index for o in a.outputs] == [0, 1, 2] and len(b.outputs) == 1
    alone = [llm.generate("def fib", replace(p, seed=7 + j))[0] for j in range(3)]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # distinct draws
    assert a.token_ids == a.outputs[0].token_ids and a.text == a.outputs[0].text
    assert b.outputs[0].token_ids == b.token_ids and b.outputs[0].text == b.text
    for o, ref in zip(a.outputs, alone):
        assert o.finish_reason == ref.finish_reason and o.logprobs == ref.logprobs
        assert o.cumulative_logprob == pytest.approx(sum(lp for lp, _ in ref.logprobs))
    unseeded = llm.generate("def fib", SamplingParams(temperature=1.0, max_tokens=12, n=4))[0].outputs
    assert len(unseeded) == 4 and len({tuple(o.token_ids) for o in unseeded}) > 1
    chats = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4, n=2))
    assert chats.outputs[0].token_ids == chats.outputs[1].token_ids  # greedy: n equal sequences


def test_n_is_refused_where_one_sequence_runs(gqa_dir):
    llm = LLM(gqa_dir)
    with pytest.raises(ValueError, match="SamplingParams.n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 2, n=3)
    with pytest.raises(ValueError, match="LLM.stream yields one sequence"):
        next(llm.stream("hi", SamplingParams(n=2)))
    with pytest.raises(ValueError, match="SamplingParams.n must be 1 for an engine request"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))
    with pytest.raises(ValueError, match="autoregressive_generate decodes one sequence"):
        autoregressive_generate(llm.model, [1, 2], SamplingParams(max_tokens=2, n=2))


def test_vllm_idioms_prompt_dicts_get_tokenizer_and_a_progress_bar(gqa_dir, capfd):
    """Code written for vLLM's LLM runs: TextPrompt / TokensPrompt dicts, get_tokenizer(), use_tqdm."""
    llm = LLM(gqa_dir)
    p = SamplingParams(temperature=0, max_tokens=6)
    ids = llm.get_tokenizer().encode("def fib")
    assert ids == llm.tokenizer.encode("def fib")
    a, b, c = llm.generate([{"prompt": "def fib"}, {"prompt_token_ids": ids}, "def fib"], p, use_tqdm=True)
    assert a.token_ids == b.token_ids == c.token_ids and a.prompt == "def fib" and b.prompt is None
    assert "Processed prompts" in capfd.readouterr().err
    assert llm.generate({"prompt": "def fib"}, p)[0].token_ids == a.token_ids
    llm.generate("def fib", p)
    assert "Processed prompts" not in capfd.readouterr().err  # silent unless asked
    for bad, words in (({"prompt": "x", "multi_modal_data": {}}, "multi_modal_data"), ({}, "one of"),
                       ({"prompt": 3}, "text or token ids")):
        with pytest.raises((ValueError, TypeError), match=words):
            llm.generate([bad], p)


def test_llm_beam_search_is_beam_search_generate_as_vllm_names_it(gqa_dir):
    from infer.generate import BeamSearchParams

    llm = LLM(gqa_dir)
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    outs = llm.beam_search(["def fib", {"prompt_token_ids": [5, 6, 7]}], params)
    for out, ids in zip(outs, [llm.tokenizer.encode("def fib"), [5, 6, 7]]):
        ref = beam_search_generate(llm.model, ids, 3, 8, llm.eos_token_ids)
        assert [(s.token_ids, s.score) for s in out.sequences] == [(h.token_ids, h.score) for h in ref]
        assert out.sequences[0].text == llm.tokenizer.decode(ref[0].token_ids)
    free = llm.beam_search("def fib", BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))[0]
    assert all(len(s.token_ids) == 8 for s in free.sequences)
    with pytest.raises(ValueError, match="temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("x", SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        llm.beam_search([[1, 10**9]], params)


def test_a_beam_step_reads_only_each_beams_keep_likeliest_tokens():
    """infer.beam's invariant, which lets the server step a search over engine requests' logprobs: laws that are -inf
    outside each beam's ``keep`` likeliest tokens pick the same beams, scores and hypotheses as the whole laws (with
    EOS ending some beams, so finished hypotheses and the stop rule are exercised)."""
    from infer.beam import BeamSearch, sparse_logprobs

    g = torch.Generator().manual_seed(0)
    V, nb = 50, 3
    for early in (False, True):
        dense, sparse = (BeamSearch(nb, 7, [3], 0.8, early) for _ in range(2))
        while not dense.done:
            rows = len(dense.beams())
            logp = (torch.randn(rows, V, generator=g) * 2).log_softmax(-1)
            logp[:, 3] += 1.5  # EOS likely enough to end beams on the way
            top = logp.topk(sparse.keep)
            alts = [list(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)]
            a, b = dense.step(logp), sparse.step(sparse_logprobs(alts, V))
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
            assert dense.beams() == sparse.beams() and torch.allclose(dense.scores, sparse.scores)
        assert sparse.done and [(h.token_ids, h.score) for h in dense.finished] == \
            [(h.token_ids, h.score) for h in sparse.finished]
        assert len(dense.finished) == nb and any(h.token_ids[-1] == 3 for h in dense.finished)
