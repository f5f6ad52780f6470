"""End-to-end: the real server (uvicorn on 127.0.0.1, ephemeral port) driven by the official openai client."""

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.llm import LLM
from infer.pooling import PoolingParams
from infer.sampling import SamplingParams
from infer.server import build_app
from infer.server.thread import ServerThread

KEY = "test-key"
NAME = "tiny"


@pytest.fixture(scope="module")
def server(ckpt_dirs):
    # target gqa, drafter mha: same tokenizer, different weights (real rejections)
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=3,
                                      max_batch_size=4, block_size=4, max_waiting_requests=64))
    with ServerThread(build_app(engine, NAME, api_key=KEY, max_body_bytes=4096)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(ckpt_dirs):
    return LLM(ckpt_dirs["gqa"])


def _wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.engine.free_kv_tokens() == engine.engine.initial_free_kv_tokens


def _raw(server, path, body: bytes | None = None, key=KEY, method=None):
    req = urllib.request.Request(server.url + path, data=body, method=method,
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_completion_greedy_equals_library_and_usage_has_acceptance(client, llm):
    r = client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    u = r.usage.model_dump()
    assert u["completion_tokens"] == 12 and u["prompt_tokens"] == len(ref.prompt_token_ids)
    assert u["num_draft_tokens"] > 0 and 0 <= u["num_accepted_tokens"] <= u["num_draft_tokens"]
    assert u["acceptance_rate"] == pytest.approx(u["num_accepted_tokens"] / u["num_draft_tokens"])


def test_chat_streaming_matches_non_streaming_and_ends_with_usage(client, llm):
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10))
    assert full.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.model_dump()["num_draft_tokens"] > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk says how many tokens so far
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].finish_reason is None
              and c.choices[0].delta.content]
    assert counts == sorted(counts) and counts[0] >= 1 and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks[1:])


def test_seeds_reproduce_and_n_gives_distinct_choices(client):
    kw = dict(model=NAME, prompt="The cat", max_tokens=12, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    many = client.completions.create(**{**kw, "n": 3})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a  # choice j uses seed + j
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.completion_tokens == 36


def test_logprobs_are_the_targets_exactly(client, llm):
    r = client.completions.create(model=NAME, prompt="import os", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = llm.tokenizer.encode("import os")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        logits = llm.model.compute_logits(llm.model(torch.tensor([ids + out])))[0, len(ids) - 1:-1]
    expect = logits.log_softmax(-1).gather(1, torch.tensor(out)[:, None]).squeeze(1)
    assert lp.token_logprobs == pytest.approx(expect.tolist(), abs=1e-4)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # a dict: tokens that decode alike share a key
    assert max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0], abs=1e-5)  # greedy: the top one


def test_echo_with_logprobs_scores_the_prompt_streamed_or_not(client, llm):
    """OpenAI's legacy completions (and lm-evaluation-harness's loglikelihood requests): echo with logprobs lists the
    prompt's tokens first, the first with no logprob, each scored by the target given those before it; text_offset
    counts characters of the echoed text. A stream sends the prompt's chunk first, then offsets carry on."""
    prompt = "import os\nimport sys"
    kw = dict(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    ch = client.completions.create(**kw).choices[0]
    lp = ch.logprobs
    ids = llm.tokenizer.encode(prompt)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        logp = llm.model.compute_logits(llm.model(torch.tensor([ids + out])))[0].log_softmax(-1)
    expect = logp[:-1].gather(1, torch.tensor(ids[1:] + out)[:, None])[:, 0]
    assert ch.text.startswith(prompt) and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expect.tolist(), abs=1e-4)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert chunks[0].text == ch.text[:len(chunks[0].text)] and chunks[0].logprobs.tokens == lp.tokens[:len(ids)]
    streamed = {k: [x for c in chunks if c.logprobs for x in getattr(c.logprobs, k)]
                for k in ("tokens", "token_logprobs", "text_offset")}
    assert "".join(c.text for c in chunks) == ch.text
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    plain = client.completions.create(**{**kw, "echo": False}).choices[0].logprobs  # no echo: the output's alone
    assert plain.tokens == lp.tokens[len(ids):] and plain.text_offset[0] == 0


def test_vllms_prompt_logprobs_score_the_prompt_with_ranks(client, llm):
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}} of the
    token itself (its rank in the target's law) and its top alternatives (ranks 1..n), a completion choice's and a
    chat completion's (one list for its n choices); echo's own logprobs keep their own count beside it; a stream is a
    400 naming the field."""
    prompt = "import os\nimport sys"
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        logp = llm.model.compute_logits(llm.model(torch.tensor([ids])))[0, :-1].float().log_softmax(-1)
    own = logp.gather(1, torch.tensor(ids[1:])[:, None])

    def check(got, ids, logp, own, top):
        assert got[0] is None and len(got) == len(ids)
        for i, entry in enumerate(got[1:]):
            mine = entry[str(ids[i + 1])]
            assert mine["logprob"] == pytest.approx(own[i, 0].item(), abs=1e-4)
            assert mine["rank"] == int((logp[i] > own[i]).sum()) + 1
            assert mine["decoded_token"] == llm.tokenizer.decode([ids[i + 1]], skip_special_tokens=False)
            best = logp[i].topk(top)
            for rank, (t, v) in enumerate(zip(best.indices.tolist(), best.values), 1):
                assert entry[str(t)]["logprob"] == pytest.approx(v.item(), abs=1e-4)
                assert t == ids[i + 1] or entry[str(t)]["rank"] == rank
            assert set(entry) == {str(t) for t in best.indices.tolist()} | {str(ids[i + 1])}

    for echo_top, top in ((1, 3), (3, 1)):  # each answer its own count of alternatives
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0, logprobs=echo_top,
                                      echo=True, n=2, extra_body={"prompt_logprobs": top})
        for ch in r.choices:
            check(ch.model_extra["prompt_logprobs"], ids, logp, own, top)
            assert ch.logprobs.top_logprobs[0] is None
            sizes = [len(t) for t in ch.logprobs.top_logprobs[1:len(ids)]]  # tokens that decode alike share a key
            assert max(sizes) == echo_top and min(sizes) >= 1
            assert ch.logprobs.token_logprobs[1:len(ids)] == pytest.approx(own[:, 0].tolist(), abs=1e-4)
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0).choices[0]
    assert "prompt_logprobs" not in (plain.model_extra or {})
    msgs = [{"role": "user", "content": "Hello there"}]
    chat_ids = llm.tokenizer.apply_chat_template(msgs, True)
    with torch.no_grad():
        clogp = llm.model.compute_logits(llm.model(torch.tensor([chat_ids])))[0, :-1].float().log_softmax(-1)
    c = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, n=2, extra_body={"prompt_logprobs": 0})
    check(c.model_extra["prompt_logprobs"], chat_ids, clogp, clogp.gather(1, torch.tensor(chat_ids[1:])[:, None]), 0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


def test_vllms_use_beam_search_answers_the_librarys_beams(server, client, llm):
    """vLLM's use_beam_search: n choices, the beams LLM.beam_search finds, best first (each step's laws come from engine
    requests' logprobs, batched and prefix-cached, the library's from its own KV slots), on both routes, with
    length_penalty, early_stopping, ignore_eos and echo; the KV is free after. A field a beam search does not apply,
    a beam field without it, or a width whose steps need more alternatives than a request reports is a 400 naming it."""
    from infer.generate import BeamSearchParams

    prompt = "def fib(n):"
    for n, extra in ((3, {}), (2, {"length_penalty": 0.5, "early_stopping": True}), (2, {"ignore_eos": True})):
        want = llm.beam_search(prompt, BeamSearchParams(beam_width=n, max_tokens=8, **extra))[0].sequences
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, n=n, echo=True,
                                      extra_body={"use_beam_search": True, **extra})
        assert [c.text for c in r.choices] == [prompt + s.text for s in want] and [c.index for c in r.choices] == \
            list(range(len(want)))
        eos = set(llm.eos_token_ids) if not extra.get("ignore_eos") else set()
        assert [c.finish_reason for c in r.choices] == \
            ["stop" if s.token_ids[-1] in eos else "length" for s in want]
        assert r.usage.completion_tokens == sum(len(s.token_ids) for s in want)
    msgs = [{"role": "user", "content": "Hello there"}]
    want = llm.beam_search({"prompt_token_ids": llm.tokenizer.apply_chat_template(msgs, True)},
                           BeamSearchParams(beam_width=2, max_tokens=6))[0].sequences
    c = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, n=2,
                                       extra_body={"use_beam_search": True})
    assert [ch.message.content for ch in c.choices] == [s.text for s in want]
    assert _wait_idle(server.engine)
    base = {"model": NAME, "prompt": prompt, "max_tokens": 4}
    for field, value, body in (("stream", True, {"use_beam_search": True}),
                               ("temperature", 0.7, {"use_beam_search": True}),
                               ("stop", ["\n"], {"use_beam_search": True}),
                               ("logprobs", 1, {"use_beam_search": True}),
                               ("length_penalty", 0.5, {}), ("early_stopping", True, {})):
        status, _, r = _raw(server, "/v1/completions", json.dumps({**base, **body, field: value}).encode())
        assert status == 400 and r["error"]["param"] == field, (field, r)
    status, _, r = _raw(server, "/v1/completions", json.dumps({**base, "use_beam_search": True, "n": 11}).encode())
    assert status == 400 and r["error"]["param"] == "n" and "too wide" in r["error"]["message"], r
    status, _, r = _raw(server, "/v1/chat/completions", json.dumps({
        "model": NAME, "messages": msgs, "use_beam_search": True, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}).encode())
    assert status == 400 and r["error"]["param"] == "tool_choice", r


def test_a_beam_search_that_finds_the_queue_full_is_a_503_and_leaves_nothing_running(ckpt_dirs):
    """A beam search's steps are requests: where --max-waiting-requests cannot take a step's beams, the answer is
    the queue's 503 with Retry-After, and every request the search had made is aborted (the KV all free)."""
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], max_batch_size=1, block_size=4,
                                      max_waiting_requests=1))
    try:
        with ServerThread(build_app(engine, NAME)) as srv:
            status, headers, r = _raw(srv, "/v1/completions", json.dumps({
                "model": NAME, "prompt": "def fib(n):", "max_tokens": 6, "n": 4, "use_beam_search": True}).encode(),
                key=None)
            assert status == 503 and {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1", r
            assert _wait_idle(engine)
    finally:
        engine.shutdown()


def test_a_content_part_the_model_cannot_read_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert "image_url" in e.value.body["message"] and e.value.body["param"] == "messages"
    r = client.chat.completions.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello"}]}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_model_card_and_vllms_tokenize_detokenize(server, client, llm):
    """OpenAI's models.retrieve (the served name's card, another name a 404), and vLLM's /tokenize (a text, or a chat
    as the chat route feeds it) and /detokenize: the server's token ids, so a client can count without a tokenizer."""
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.model_dump()["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    status, _, r = _raw(server, "/tokenize", json.dumps({"model": NAME, "prompt": "def fib(n):"}).encode())
    assert status == 200 and r["tokens"] == llm.tokenizer.encode("def fib(n):") and r["count"] == len(r["tokens"])
    msgs = [{"role": "user", "content": "Hello there"}]
    status, _, r = _raw(server, "/tokenize", json.dumps({"model": NAME, "messages": msgs}).encode())
    assert status == 200 and r["tokens"] == llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2)
    assert chat.usage.prompt_tokens == r["count"]
    status, _, r = _raw(server, "/detokenize", json.dumps({"model": NAME, "tokens": r["tokens"]}).encode())
    assert status == 200 and "Hello there" in r["prompt"]
    for path, body, param in (("/tokenize", {"model": NAME}, "prompt"),
                              ("/tokenize", {"model": NAME, "prompt": "x", "messages": msgs}, "prompt"),
                              ("/detokenize", {"model": NAME, "tokens": [1, 10 ** 9]}, "tokens"),
                              ("/detokenize", {"model": "other", "tokens": [1]}, "model")):
        status, _, r = _raw(server, path, json.dumps(body).encode())
        assert status in (400, 404) and r["error"]["param"] == param, (path, r)


def test_embeddings_with_the_openai_client(server, client, llm):
    """OpenAI's embeddings.create (the client asks for base64 and decodes it): each input's vector is the library's
    (LLM.embed, the last token's state normalized), as floats too; token ids in, usage counted, metrics kept; the
    inputs it cannot embed are 400s naming the field, and nothing is left running."""
    texts = ["def fib(n):", "hello there"]
    want = [o.outputs.embedding for o in llm.embed(texts)]
    r = client.embeddings.create(model=NAME, input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.model == NAME
    for d, w in zip(r.data, want):
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(w), rtol=1e-6, atol=1e-6)
    ids = llm.tokenizer.encode(texts[1])
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(llm.tokenizer.encode(texts[0])) + len(ids)
    floats = client.embeddings.create(model=NAME, input=[ids], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(r.data[1].embedding, abs=1e-6)
    status, _, raw = _raw(server, "/v1/embeddings", json.dumps(
        {"model": NAME, "input": texts[1], "normalize": False, "truncate_prompt_tokens": 2}).encode())
    assert status == 200 and raw["usage"]["prompt_tokens"] == 2
    assert abs(sum(x * x for x in raw["data"][0]["embedding"]) - 1) > 1e-3  # not normalized
    width = llm.model.config.hidden_size
    assert len(client.embeddings.create(model=NAME, input="x", dimensions=width).data[0].embedding) == width
    msgs = [{"role": "user", "content": "Hello there"}]  # vLLM's chat form: the conversation as the chat route renders
    status, _, raw = _raw(server, "/v1/embeddings", json.dumps({"model": NAME, "messages": msgs}).encode())
    chat_ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    assert status == 200 and raw["usage"]["prompt_tokens"] == len(chat_ids)
    assert raw["data"][0]["embedding"] == pytest.approx(
        llm.embed({"prompt_token_ids": chat_ids})[0].outputs.embedding, abs=1e-6)
    for body, param in (({"input": "x", "dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                        ({"input": ""}, "input"), ({"input": [[1, 10 ** 9]]}, "input"),
                        ({"input": [1] * 300}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"input": "x", "model": "other"}, "model"), ({}, "input"),
                        ({"input": "x", "messages": msgs}, "input"),
                        ({"messages": msgs, "chat_template": "{{ x }}"}, "chat_template")):
        status, _, raw = _raw(server, "/v1/embeddings", json.dumps({"model": NAME, **body}).encode())
        assert status in (400, 404) and raw["error"]["param"] == param, (body, raw)
    req = urllib.request.Request(server.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})
    metrics = urllib.request.urlopen(req).read().decode()
    assert re.search(r"^infer_embedded_inputs_total 6\.0$", metrics, re.M), metrics
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        build_app(server.engine, NAME, pooling="cls")
    with ServerThread(build_app(server.engine, NAME, pooling="mean")) as means:  # `infer serve --pooling mean`
        r = openai.OpenAI(base_url=means.base_url, api_key="-", max_retries=0).embeddings.create(model=NAME,
                                                                                               input=texts)
    for d, w in zip(r.data, llm.embed(texts, PoolingParams("mean"))):
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(w.outputs.embedding), rtol=1e-6, atol=1e-6)
    assert _wait_idle(server.engine)


def _embedded_inputs(server) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req).read().decode()
    return float(re.search(r"^infer_embedded_inputs_total (\S+)$", text, re.M).group(1))


def test_score_and_rerank_read_the_library_scores(server, llm):
    """vLLM's /score (one text_1 against each text_2, or pairwise) and /rerank (Jina's and Cohere's shape): the
    scores are LLM.score's, the documents best first, top_n of them; each distinct text embedded once (usage and
    the metric count them); bad input is a 400 naming the field, and nothing is left running."""
    query, docs = "def fib(n):", ["def fib(n): return n", "hello there", "a"]
    want = [o.outputs.score for o in llm.score(query, docs)]
    before = _embedded_inputs(server)
    for path in ("/score", "/v1/score"):
        status, _, raw = _raw(server, path, json.dumps({"model": NAME, "text_1": query, "text_2": docs}).encode())
        assert status == 200 and raw["object"] == "list" and raw["model"] == NAME, raw
        assert [d["index"] for d in raw["data"]] == [0, 1, 2] and {d["object"] for d in raw["data"]} == {"score"}
        assert [d["score"] for d in raw["data"]] == pytest.approx(want, abs=1e-6)
        tokens = sum(len(llm.tokenizer.encode(t)) for t in [query] + docs)
        assert raw["usage"]["prompt_tokens"] == raw["usage"]["total_tokens"] == tokens
    assert _embedded_inputs(server) - before == 8  # 4 distinct texts a call
    status, _, raw = _raw(server, "/v1/score", json.dumps(
        {"model": NAME, "text_1": [query, docs[1]], "text_2": docs[:2]}).encode())
    pairwise = [o.outputs.score for o in llm.score([query, docs[1]], docs[:2])]
    assert status == 200 and [d["score"] for d in raw["data"]] == pytest.approx(pairwise, abs=1e-6)
    best = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, _, raw = _raw(server, path, json.dumps(
            {"model": NAME, "query": query, "documents": [docs[0], {"text": docs[1]}, docs[2]], "top_n": 2}).encode())
        assert status == 200 and raw["model"] == NAME and raw["usage"]["total_tokens"] == tokens, raw
        assert [r["index"] for r in raw["results"]] == best[:2]
        assert [r["relevance_score"] for r in raw["results"]] == pytest.approx([want[i] for i in best[:2]], abs=1e-6)
        assert [r["document"]["text"] for r in raw["results"]] == [docs[i] for i in best[:2]]
    status, _, raw = _raw(server, "/v1/rerank", json.dumps(
        {"model": NAME, "query": query, "documents": docs, "return_documents": False}).encode())
    assert status == 200 and [r["index"] for r in raw["results"]] == best and "document" not in raw["results"][0]
    long = " ".join(["hello"] * 400)
    for path, body, param in (("/v1/score", {"text_1": [query, query], "text_2": docs}, "text_1"),
                              ("/v1/score", {"text_1": query, "text_2": []}, "text_2"),
                              ("/v1/score", {"text_1": query, "text_2": ["x", ""]}, "text_2"),
                              ("/v1/score", {"text_1": long, "text_2": "x"}, "text_1"),
                              ("/v1/score", {"text_1": query, "text_2": "x", "truncate_prompt_tokens": 0},
                               "truncate_prompt_tokens"),
                              ("/v1/score", {"text_1": query}, "text_2"),
                              ("/v1/rerank", {"query": query, "documents": []}, "documents"),
                              ("/v1/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n"),
                              ("/v1/rerank", {"query": query, "documents": [long]}, "documents"),
                              ("/v1/rerank", {"query": query, "documents": docs, "model": "other"}, "model")):
        status, _, raw = _raw(server, path, json.dumps({"model": NAME, **body}).encode())
        assert status in (400, 404) and raw["error"]["param"] == param, (body, raw)
    status, _, raw = _raw(server, "/v1/score", json.dumps({"model": NAME, "text_1": query, "text_2": "x",
                                                           "truncate_prompt_tokens": 2}).encode())
    assert status == 200 and raw["usage"]["prompt_tokens"] == 2 + min(2, len(llm.tokenizer.encode("x")))
    assert _wait_idle(server.engine)


def test_chat_continues_a_prefilled_answer(server, client, llm):
    """vLLM's continue_final_message (add_generation_prompt false): the reply continues the last message, an
    assistant's begun, as the library's LLM.chat does; asked of a user's message it is a 400 naming the field."""
    msgs = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My favourite is"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.chat(msgs, params, add_generation_prompt=False, continue_final_message=True)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True})
    assert r.choices[0].message.content == want.text
    ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert r.usage.prompt_tokens == len(ids) == len(want.prompt_token_ids)
    assert llm.tokenizer.decode(ids).endswith("My favourite is")  # the turn left open
    opened = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=1)  # the default: a new turn
    assert opened.usage.prompt_tokens > len(ids)
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False,
                                                     "messages": msgs[:1]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": NAME, "messages": msgs, "max_tokens": 2,
                                              "extra_body": {k: v for k, v in extra.items() if k != "messages"},
                                              **({"messages": extra["messages"]} if "messages" in extra else {})})
        assert e.value.body["param"] == "continue_final_message"


def test_a_predicted_output_reaches_the_proposer_and_changes_nothing(ckpt_dirs):
    """OpenAI's ``prediction`` on a server whose proposer copies (the suffix tree, as SmolLM2's default does): the
    request carries the prediction's tokens (tests/test_suffix.py shows the drafts copying them) and the answer is
    the same. (This tiny model's outputs do not tokenise back to themselves, so a text prediction of one matches
    little here; SmolLM2's do: docs/benchmarks.md.)"""
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], proposer="suffix", spec_length=3, max_batch_size=2))
    seen = []
    add = engine.engine.add_request
    engine.engine.add_request = lambda *a, **kw: (seen.append(kw.get("prediction")), add(*a, **kw))[1]
    try:
        with ServerThread(build_app(engine, NAME)) as srv:
            c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
            kw = dict(model=NAME, messages=[{"role": "user", "content": "Count to ten"}], max_tokens=24,
                      temperature=0, extra_body={"ignore_eos": True})
            plain = c.chat.completions.create(**kw).choices[0].message.content
            for content in (plain, [{"type": "text", "text": plain}], "something else entirely"):
                told = c.chat.completions.create(**kw, prediction={"type": "content", "content": content})
                assert told.choices[0].message.content == plain
            tok = engine.engine.tokenizer
            assert seen == [None] + [tok.encode(plain, add_special_tokens=False)] * 2 + [
                tok.encode("something else entirely", add_special_tokens=False)]
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(**kw, prediction={"type": "other", "content": plain})
    finally:
        engine.shutdown()


def test_error_statuses(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=100000)
    assert "exceeds" in e.value.body["message"] and "100000" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert _raw(server, "/health", key="wrong")[0] == 200  # /health needs no key
    status, _, body = _raw(server, "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, _, body = _raw(server, "/v1/completions", json.dumps({"model": NAME, "prompt": "x" * 10000}).encode())
    assert status == 413
    status, _, body = _raw(server, "/v1/completions", b"{not json")
    assert status == 400 and "error" in body
    status, _, body = _raw(server, "/v1/completions", json.dumps({"model": NAME}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    assert [m.id for m in client.models.list().data] == [NAME]
    assert _wait_idle(server.engine)


def test_client_disconnect_aborts_and_frees_kv(server, client):
    stats = server.engine.engine.stats
    aborted = stats.requests_finished.get("abort", 0)
    stream = client.completions.create(model=NAME, prompt="Hello", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()  # hang up mid-stream
    assert _wait_idle(server.engine)
    assert stats.requests_finished.get("abort", 0) == aborted + 1  # aborted, not run to its 200 tokens
    assert _raw(server, "/health")[0] == 200
    assert _raw(server, "/metrics", key="wrong")[0] == 401  # every route but /health needs the key


def test_metrics(server, client):
    client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0)
    req = urllib.request.Request(server.url + "/metrics", headers={"authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req).read().decode()
    for name in ("infer_requests_total", "infer_prompt_tokens_total", "infer_generation_tokens_total",
                 "infer_time_to_first_token_seconds_bucket", "infer_inter_token_latency_seconds_bucket",
                 "infer_requests_running", "infer_requests_waiting", "infer_kv_cache_usage",
                 "infer_spec_drafts_total", "infer_spec_draft_tokens_total", "infer_spec_accepted_tokens_total",
                 "infer_spec_accepted_tokens_per_position_total"):
        assert name in text, name


def test_full_queue_answers_503_with_retry_after(ckpt_dirs):
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], max_batch_size=1, max_waiting_requests=1))
    with ServerThread(build_app(engine, NAME)) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        kw = dict(model=NAME, prompt="Hi", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        held = [c.completions.create(**kw)]
        while engine.engine.num_running == 0:  # admitted, so the queue is empty again
            time.sleep(0.005)
        held.append(c.completions.create(**kw))  # waits behind it: the queue is now full
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**kw)
        assert e.value.status_code == 503 and e.value.response.headers.get("retry-after") == "1"
        for s in held:
            s.close()
        assert _wait_idle(engine)
    engine.shutdown()


def test_many_concurrent_streaming_clients(server):
    """32 streaming clients x 4 requests: every request completes, no 5xx, the KV pool is fully free after."""
    import asyncio

    async def main():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)

        async def client_(i):
            done = 0
            for j in range(4):
                s = await c.completions.create(model=NAME, prompt=f"req {i} {j}", max_tokens=6, temperature=0.8,
                                               stream=True, stream_options={"include_usage": True}, seed=i * 4 + j)
                usage = None
                async for chunk in s:
                    usage = chunk.usage or usage
                done += usage is not None and usage.completion_tokens > 0
            return done

        return await asyncio.gather(*[client_(i) for i in range(32)])

    assert asyncio.run(main()) == [4] * 32
    assert _wait_idle(server.engine)


def test_serve_rejects_bad_flags_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infer.server", "--model", str(tmp_path), "--proposer", "hybrid"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "needs a draft_model" in r.stderr
    r = subprocess.run([sys.executable, "-m", "infer.server", "--model", str(tmp_path), "--kv-cache-backend", "ring"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "kv_cache_backend" in r.stderr and r.stderr.strip().count("\n") == 0


def test_vllm_command_lines_run_as_they_are():
    """vLLM's flag names for the same settings (--max-model-len, --max-num-seqs, -tp) and --enable-auto-tool-choice,
    which needs --tool-call-parser, as in vLLM."""
    from infer.server.__main__ import add_serve_args, engine_config

    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = engine_config(p.parse_args(["--model", "m", "--max-model-len", "64", "--max-num-seqs", "3", "-tp", "1",
                                      "--scheduling-policy", "priority"]))
    assert (cfg.max_seq_len, cfg.max_batch_size, cfg.tensor_parallel_size) == (64, 3, 1)
    assert cfg.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        engine_config(p.parse_args(["--model", "m", "--enable-auto-tool-choice"]))
    a = p.parse_args(["--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert engine_config(a) and a.tool_call_parser == "hermes"


def test_a_chat_template_of_the_servers_own(ckpt_dirs, tmp_path):
    """--chat-template (vLLM's): the server renders chats with it, not the checkpoint's (the library's LLM.chat takes
    one too); one that cannot render a conversation is refused at start with the template engine's message."""
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    from infer.server.__main__ import chat_template

    assert chat_template(argparse.Namespace(chat_template=str(path))) == template  # a file, or the text itself
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], max_batch_size=2))
    try:
        with pytest.raises(ValueError, match="cannot render a conversation"):
            build_app(engine, NAME, chat_template="{% for m in messages %}")
        with ServerThread(build_app(engine, NAME, chat_template=template)) as srv:
            msgs = [{"role": "user", "content": "hi"}]
            status, _, ids = _raw(srv, "/tokenize", json.dumps({"model": NAME, "messages": msgs}).encode())
            status, _, text = _raw(srv, "/detokenize", json.dumps({"model": NAME, "tokens": ids["tokens"]}).encode())
            assert status == 200 and text["prompt"] == "[user] hi\n>"
            c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
            r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, temperature=0)
            assert r.usage.prompt_tokens == len(ids["tokens"])
    finally:
        engine.shutdown()
    llm = LLM(ckpt_dirs["gqa"])
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), chat_template=template)
    assert out.prompt_token_ids == ids["tokens"]


def test_a_requests_own_chat_template_and_its_kwargs(ckpt_dirs):
    """vLLM's chat_template and chat_template_kwargs: a request's template is rendered where the server trusts it
    (--trust-request-chat-template; else a 400, test_server_hardening), its kwargs always, on the chat route and
    /tokenize alike, as the library's LLM.chat renders them. A template that cannot render the messages (its own
    raise_exception, a syntax error) and a kwarg the renderer sets itself are 400s naming the field, never a 500;
    the server's own template failing on a request's messages names them (``input`` on the Responses route)."""
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ cue | default('>') }}{% endif %}")
    own = ("{% for m in messages %}{% if m.role == 'system' and m.content == 'refuse' %}"
           "{{ raise_exception('this template refuses that system message') }}{% endif %}{{ m.content }}|"
           "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], max_batch_size=2))
    try:
        with ServerThread(build_app(engine, NAME, chat_template=own, trust_request_chat_template=True)) as srv:
            def post(path, body):
                return _raw(srv, path, json.dumps({"model": NAME, **body}).encode())

            texts = []
            for extra in ({}, {"chat_template": template}, {"chat_template": template,
                                                           "chat_template_kwargs": {"cue": "A:"}}):
                status, _, ids = post("/tokenize", {"messages": msgs, **extra})
                assert status == 200, ids
                texts.append(post("/detokenize", {"tokens": ids["tokens"]})[2]["prompt"])
            assert texts == ["hi|A:", "[user] hi\n>", "[user] hi\nA:"]
            begun = {"messages": [*msgs, {"role": "assistant", "content": "Sure"}], "continue_final_message": True}
            status, _, cont = post("/tokenize", {**begun, "add_generation_prompt": False})
            assert post("/detokenize", {"tokens": cont["tokens"]})[2]["prompt"] == "hi|Sure"
            status, _, err = post("/tokenize", begun)
            assert status == 400 and err["error"]["param"] == "continue_final_message"
            c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
            extra = {"chat_template": template, "chat_template_kwargs": {"cue": "A:"}}
            r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, extra_body=extra)
            assert r.usage.prompt_tokens == len(ids["tokens"])
            for body, param, words in (
                    ({"chat_template_kwargs": {"messages": [], "cue": 1}}, "chat_template_kwargs", "'messages'"),
                    ({"chat_template": "{{ raise_exception('no chats today') }}"}, "chat_template", "no chats today"),
                    ({"chat_template": "{% for m in messages %}"}, "chat_template", "TemplateSyntaxError"),
                    ({"chat_template": " "}, "chat_template", "empty"),
                    ({"messages": [{"role": "system", "content": "refuse"}, *msgs]}, "messages", "refuses that")):
                for route in ("/v1/chat/completions", "/tokenize"):
                    status, _, err = post(route, {"messages": msgs, "max_tokens": 2, **body})
                    assert status == 400 and err["error"]["param"] == param and words in err["error"]["message"], err
            status, _, err = post("/v1/responses", {"input": "hi", "instructions": "refuse"})
            assert status == 400 and err["error"]["param"] == "input" and "refuses" in err["error"]["message"], err
    finally:
        engine.shutdown()
    llm = LLM(ckpt_dirs["gqa"])
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6), chat_template=template,
                    chat_template_kwargs={"cue": "A:"})
    assert want.prompt_token_ids == ids["tokens"] and r.choices[0].message.content == want.text
    with pytest.raises(ValueError, match="cannot set 'tokenize'"):
        llm.chat(msgs, chat_template_kwargs={"tokenize": True})


def test_priorities_are_served_where_the_server_schedules_by_them(ckpt_dirs):
    """vLLM's request priority on --scheduling-policy priority: the chat, completions and Responses routes take it
    (the answer is the one without it: scheduling changes no token); with a beam search it is a 400 naming it, as
    where the server serves first come, first served (test_server_hardening)."""
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], max_batch_size=1, scheduling_policy="priority"))
    msgs = [{"role": "user", "content": "hi"}]
    try:
        with ServerThread(build_app(engine, NAME)) as srv:
            c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
            ask = dict(model=NAME, messages=msgs, max_tokens=6, temperature=0)
            texts = [c.chat.completions.create(**ask, extra_body=extra).choices[0].message.content
                     for extra in ({}, {"priority": -3}, {"priority": 7})]
            assert texts[0] == texts[1] == texts[2]
            r = c.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=0, extra_body={"priority": 2})
            assert r.choices[0].finish_reason == "length"
            assert c.responses.create(model=NAME, input="hi", max_output_tokens=6, temperature=0,
                                      extra_body={"priority": 1}).output_text == texts[0]
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(**ask, extra_body={"priority": 1, "use_beam_search": True, "n": 2})
            assert e.value.body["param"] == "priority"
    finally:
        engine.shutdown()


def test_a_tool_call_parser_for_a_template_without_tools_is_refused(ckpt_dirs):
    """--tool-call-parser serves tool_choice "auto", which a model never shown its tools cannot use: refused at start
    (the tiny checkpoints' template, as SmolLM2's, shows no tools)."""
    import socket

    with socket.socket() as s:  # a port free now (the check happens before anything listens on it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "infer.server", "--model", str(ckpt_dirs["gqa"]), "--port", str(port),
                        "--tool-call-parser", "hermes"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not show tools to the model" in r.stderr.splitlines()[-1], r.stderr
    r = subprocess.run([sys.executable, "-m", "infer.server", "--model", str(ckpt_dirs["gqa"]),
                        "--tool-call-parser", "mistral"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'mistral'" in r.stderr


def test_speculation_off_per_request_and_the_spec_extension(client):
    kw = dict(model=NAME, prompt="def fib(n):", max_tokens=16, temperature=0)
    spec = client.completions.create(**kw, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True, "speculation": False})
    assert plain.choices[0].text == spec.choices[0].text  # same output, no drafts
    assert plain.usage.model_dump()["num_draft_tokens"] == 0 < spec.usage.model_dump()["num_draft_tokens"]
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "include_spec": True}))
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_dump()["spec"]["tokens"]]
    assert len(tokens) == 16 and {t["source"] for t in tokens} <= {"target", "accepted", "recovered", "bonus"}
    ends = [t for t in tokens if t["source"] in ("recovered", "bonus")]  # one per speculative round
    accepted = sum(t["source"] == "accepted" for t in tokens)
    assert ends and all(t["k"] > 0 for t in ends)
    usage = chunks[-1].usage.model_dump()
    assert accepted == usage["num_accepted_tokens"] and sum(t["k"] for t in ends) == usage["num_draft_tokens"]
    plain_chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    assert all("spec" not in c.choices[0].model_dump() for c in plain_chunks if c.choices)  # only when asked


def test_prompt_tokens_served_from_the_prefix_cache_are_reported(ckpt_dirs):
    """The library's RequestOutput.num_cached_tokens (vLLM's), usage.prompt_tokens_details.cached_tokens on both
    routes, streamed too (OpenAI's), and the Responses API's input_tokens_details: 0 for a prompt met first, then its
    whole blocks but the one holding its last token (which must run to give logits); a chat's prompt is cached for
    the Responses API's same conversation."""
    prompt, greedy = "The quick brown fox jumps over the lazy dog. " * 3, SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(ckpt_dirs["gqa"], enable_prefix_caching=True, block_size=4)
    first, again = (llm.generate([prompt], greedy)[0] for _ in range(2))

    def hit(n):
        return (n - 1) // 4 * 4

    assert first.num_cached_tokens == 0 < again.num_cached_tokens == hit(len(first.prompt_token_ids))
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=3,
                                      block_size=4, enable_prefix_caching=True))
    with ServerThread(build_app(engine, NAME)) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        done = [c.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0).usage for _ in range(2)]
        assert [u.prompt_tokens_details.cached_tokens for u in done] == [0, hit(done[0].prompt_tokens)]
        messages = [{"role": "user", "content": prompt}]
        chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0).usage
        streamed = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))[-1].usage
        assert chat.prompt_tokens_details.cached_tokens == 0 < hit(chat.prompt_tokens)
        assert streamed.prompt_tokens_details.cached_tokens == hit(chat.prompt_tokens)
        response = c.responses.create(model=NAME, input=prompt, max_output_tokens=4, temperature=0).usage
        assert response.input_tokens == chat.prompt_tokens
        assert response.input_tokens_details.cached_tokens == hit(chat.prompt_tokens)
    engine.shutdown()


SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"enum": [1, 2, 3]}},
          "required": ["word", "n"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(client, llm):
    """Both routes take OpenAI's response_format; streamed and not, the text parses and follows the schema, and
    greedy output equals the library's under the same constraint."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "Answer in JSON"}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0, response_format=fmt)
    text = full.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, structured={"json_schema": SCHEMA})).text
    chunks = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=1.0, seed=5,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)
    r = client.completions.create(model=NAME, prompt="JSON:", max_tokens=60, temperature=1.0, seed=2,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason != "length":  # a random model may not close its object in 60 tokens
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


def test_structured_outputs_extension(client):
    r = client.completions.create(model=NAME, prompt="Pick:", max_tokens=10, temperature=1.0, seed=1, n=4,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert {c.text for c in r.choices} <= {"alpha", "beta"}
    r = client.completions.create(model=NAME, prompt="Code:", max_tokens=12, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    r = client.completions.create(model=NAME, prompt="List:", max_tokens=30, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "[" [0-9] ("," [0-9])* "]"'}})
    assert re.fullmatch(r"\[\d(,\d)*\]", r.choices[0].text) or (r.choices[0].finish_reason == "length"
                                                                  and re.fullmatch(r"\[\d(,\d)*,?", r.choices[0].text))


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs", "nothing_defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "response_format", "not both"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param, words):
    status, _, answer = _raw(server, "/v1/completions", json.dumps({"model": NAME, "prompt": "x", **body}).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert _wait_idle(server.engine)


def _bench_args(*args):
    from infer.bench_serve import add_bench_args

    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(list(args))


def test_bench_serve_drives_the_server_and_reports(server, tmp_path):
    """`infer bench-serve`: the load runs, the summary counts what it got, acceptance comes from the usage chunks."""
    from infer.bench_serve import run_bench

    common = ["--base-url", server.base_url, "--api-key", KEY, "--prompt", "def fib(n):"]
    r = run_bench(_bench_args(*common, "--clients", "2", "--requests-per-client", "2", "--max-tokens", "6",
                              "--json", str(tmp_path / "bench.json")))
    assert r["ok"] == 4 and r["failed"] == {} and 4 <= r["output_tokens"] <= 24
    assert r["ttft_p50"] is not None and r["latency_p99"] >= r["latency_p50"] > 0
    assert r["acceptance_rate"] is not None and 0.0 <= r["acceptance_rate"] <= 1.0  # the server speculates
    assert json.loads((tmp_path / "bench.json").read_text())["ok"] == 4
    # requests the server refuses are counted with its reason, and the load goes on
    r = run_bench(_bench_args(*common, "--clients", "1", "--requests-per-client", "2", "--max-tokens", "100000"))
    assert r["ok"] == 0 and r["failed"] == {400: 2} and "exceeds the maximum sequence length" in r["failures"][400]


def test_bench_serve_without_a_server_is_one_clear_error():
    from infer.bench_serve import run_bench

    with pytest.raises(ValueError, match=r"no server answers at http://127\.0\.0\.1:1/v1"):
        run_bench(_bench_args("--base-url", "http://127.0.0.1:1/v1"))


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def _streamed_calls(chunks) -> tuple[list[dict], str]:
    """A streamed answer's tool calls, assembled from their deltas as OpenAI's clients do, and its finish reason."""
    calls, finish = {}, None
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_tool_choice_named_function_is_its_arguments_as_the_library_constrains_them(client, llm):
    """A named tool_choice answers one call whose arguments follow its schema, greedy the library's text under the
    same schema; streamed, the deltas assemble into the same call."""
    import jsonschema

    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                       temperature=0)
    m = r.choices[0]
    assert m.message.content is None and m.finish_reason == "stop"
    (call,) = m.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=60, structured={"json_schema": WEATHER}),
                   tools=TOOLS)
    assert call.function.arguments == ref.text
    streamed, finish = _streamed_calls(client.chat.completions.create(
        model=NAME, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0, stream=True))
    assert finish == "stop" and [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", ref.text)]
    assert streamed[0]["id"].startswith("call_")


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_answers_calls_of_the_tools(client, parallel):
    """"required": one or more calls (one with parallel_tool_calls false), each a tool's name and arguments that
    follow its schema, finish_reason "tool_calls"; streamed, the same calls (greedy), each sent whole."""
    import jsonschema

    kw = dict(model=NAME, messages=[{"role": "user", "content": "Weather and time?"}], tools=TOOLS,
              tool_choice="required", max_tokens=120, temperature=0, parallel_tool_calls=parallel)
    r = client.chat.completions.create(**kw).choices[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert r.message.content is None
    if r.finish_reason != "length" or not parallel:  # a random model may list calls past max_tokens
        assert r.finish_reason == "tool_calls" and r.message.tool_calls
    assert len(r.message.tool_calls) <= (120 if parallel else 1)
    for call in r.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == r.finish_reason
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments)
                                                               for c in r.message.tool_calls]


def test_a_conversation_with_calls_and_results_reaches_the_template(server, client):
    """The history of a tool call (the assistant's calls, the tool's result) is accepted and rendered by the
    checkpoint's template, which shows the tool's result as its own turn."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city":"Paris","unit":"C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "SUNNY-21"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls
    status, _, ids = _raw(server, "/tokenize", json.dumps({"model": NAME, "messages": msgs, "tools": TOOLS}).encode())
    assert status == 200
    status, _, text = _raw(server, "/detokenize", json.dumps({"model": NAME, "tokens": ids["tokens"]}).encode())
    assert "tool<|end_header_id|>\n\nSUNNY-21" in text["prompt"]


@pytest.mark.parametrize("route, body, param, words", [
    ("chat", {"tools": TOOLS}, "tool_choice", "'auto'"),
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "'required'"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ("chat", {"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "unique"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
              "tool_choice": "required"}, "tools", "foo"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "not both"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
     "tools", "pattern"),
    ("completions", {"tools": TOOLS}, "tools", "chat"),
])
def test_tool_requests_that_cannot_be_answered_are_400_naming_the_field(server, route, body, param, words):
    path, head = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}) if route == "chat"
                  else ("/v1/completions", {"prompt": "x"}))
    status, _, answer = _raw(server, path, json.dumps({"model": NAME, **head, **body}).encode())
    assert status == 400, answer
    assert param in (answer["error"]["param"] or "") and words in answer["error"]["message"], answer
    assert _wait_idle(server.engine)
