"""What an adversarial run against ``infer serve`` found, each answered (issue 18, part 2), through the real server:
bad input is a 400 naming the field (never a 500), a non-streaming request whose client has gone is aborted and its
KV freed, tiny temperatures are greedy, a megabyte of prompt does not stall /health, the OpenAPI schema documents
what the server sends, and SIGTERM drains within its grace period with a final event on every stream."""

import json
import re
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.llm import LLM
from infer.sampling import SamplingParams
from infer.server import build_app
from infer.server.thread import ServerThread
from infer.testing import make_tiny_llama, server_log, start_server, stop_server
from infer.token_bans import bad_words_ids

NAME = "tiny"
KEY = "hardening-key"  # with a key: the auth middleware must not hide a client's disconnect from the route


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("long"), "gqa", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(long_ckpt):
    engine = AsyncEngine(EngineConfig(model=long_ckpt, max_batch_size=16, block_size=16, max_waiting_requests=64))
    with ServerThread(build_app(engine, NAME, api_key=KEY, max_body_bytes=4 << 20)) as srv:
        srv.engine = engine
        yield srv
    engine.shutdown()


def _post(server, path, body, timeout=30, kind="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"content-type": kind,
                                                                         "authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _kv_free(engine) -> bool:
    return engine.engine.free_kv_tokens() == engine.engine.initial_free_kv_tokens


CHAT = "/v1/chat/completions"
BAD = [  # (route, raw JSON body, the parameter the 400 must name)
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages.0.content"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2, 99999], "echo": true}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": 36893488147419103232}', "seed"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": -1}', "seed"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "16"}', "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "stream"),
    # vLLM's priority where the server serves first come, first served (it would be ignored)
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "priority": 1}', "priority"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "priority": 1.5}', "priority"),
]


@pytest.mark.parametrize("route, body, param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, route, body, param):
    status, r = _post(server, route, body)
    assert status == 400, r
    assert r["error"]["param"].startswith(param) and r["error"]["type"] == "invalid_request_error"


UNSUPPORTED = [  # OpenAI fields and vLLM extensions that would change the output and that infer does not implement:
    # (route, field, value asking for something, its default as clients send it)
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], []),
    ("/v1/completions", "suffix", "x", ""), ("/v1/completions", "best_of", 3, 1),
    (CHAT, "chat_template", "{{ messages }}", None),
    (CHAT, "functions", [{"name": "f", "parameters": {}}], []), (CHAT, "function_call", "auto", "none"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, None), (CHAT, "modalities", ["text", "audio"], ["text"]),
    (CHAT, "web_search_options", {"search_context_size": "low"}, None), (CHAT, "reasoning_effort", "high", None),
    (CHAT, "verbosity", "low", None),
]


@pytest.mark.parametrize("route, field, value, default", UNSUPPORTED, ids=[f for _, f, _, _ in UNSUPPORTED])
def test_unsupported_openai_fields_are_refused_by_name_not_dropped(server, route, field, value, default):
    """A request asking for what the server does not do gets a 400 naming the field (it was dropped in silence); the
    same field at its default (as clients send it: presence_penalty 0, logit_bias {}, tools [], best_of 1) is served."""
    body = {"model": NAME, "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]} if route == CHAT
                                               else {"prompt": "x"})}
    status, r = _post(server, route, {**body, field: value})
    assert status == 400 and r["error"]["param"] == field and "not supported" in r["error"]["message"], r
    status, r = _post(server, route, {**body, field: default})
    assert status == 200, r


def test_openai_penalties_and_logit_bias_reach_the_sampler(server, long_ckpt):
    """presence_penalty, frequency_penalty and logit_bias are served as the library applies them (greedy: the same
    text, another than without them); out of range they are a 400 naming the field."""
    llm = LLM(long_ckpt)
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate(["def f(x):"], SamplingParams(**greedy))[0]
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    banned = {str(t): -100 for t in set(plain.token_ids)}  # every token the plain text used, banned
    for extra in ({"presence_penalty": 0.8, "frequency_penalty": 1.2}, {"logit_bias": banned}):
        want = llm.generate(["def f(x):"], SamplingParams(**greedy, **extra))[0]
        assert want.text != plain.text
        status, r = _post(server, "/v1/completions", {**body, **extra})
        assert status == 200 and r["choices"][0]["text"] == want.text
    assert not set(want.token_ids) & set(plain.token_ids)
    for field, value in (("frequency_penalty", 2.5), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"99999": 1})):
        status, r = _post(server, "/v1/completions", {**body, field: value})
        assert status == 400 and r["error"]["param"] == field, r


def test_vllm_bad_words_and_allowed_token_ids_reach_the_sampler(server, long_ckpt):
    """vLLM's bad_words and allowed_token_ids are served as the library applies them (greedy: the same text, another
    than without them; no banned word in it, no token outside the allowed ones); malformed, a 400 naming the field."""
    llm = LLM(long_ckpt)
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate(["def f(x):"], SamplingParams(**greedy))[0]
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    tok = llm.get_tokenizer()
    word = next(w for w in (tok.decode([t]).strip() for t in plain.token_ids) if w)  # the first visible token's text
    allowed = sorted(set(plain.token_ids[::2]))
    wants = []
    for extra in ({"bad_words": [word]}, {"allowed_token_ids": allowed}):
        wants.append(llm.generate(["def f(x):"], SamplingParams(**greedy, **extra))[0])
        assert wants[-1].text != plain.text
        status, r = _post(server, "/v1/completions", {**body, **extra})
        assert status == 200 and r["choices"][0]["text"] == wants[-1].text
        chat = {"model": NAME, "messages": [{"role": "user", "content": "def f(x):"}], **greedy, **extra}
        assert _post(server, CHAT, chat)[0] == 200
    out = wants[0].token_ids
    assert not any(out[i:i + len(w)] == w for w in bad_words_ids([word], tok) for i in range(len(out)))
    assert set(wants[1].token_ids) <= set(allowed)
    for field, value, more in (("bad_words", [""], {}), ("bad_words", "x", {}), ("allowed_token_ids", [], {}),
                               ("allowed_token_ids", [-1], {}), ("allowed_token_ids", [99999], {}),
                               ("bad_words", ["x"], {"guided_regex": "[a-z]+"})):
        status, r = _post(server, "/v1/completions", {**body, field: value, **more})
        assert status == 400 and r["error"]["param"] == field, (field, value, r)


def test_vllm_skip_special_tokens_false_writes_them_out(server):
    """skip_special_tokens false (vLLM's): special tokens are in the text, the answer's and an echoed prompt's (here
    the only allowed token is BOS, a special one); by default, and true, they are left out."""
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "allowed_token_ids": [0], "echo": True}
    for skip, text in ((None, "x"), (True, "x"), (False, "<|begin_of_text|>x" + "<|begin_of_text|>" * 2)):
        status, r = _post(server, "/v1/completions", {**body, **({} if skip is None else {"skip_special_tokens": skip})})
        assert status == 200 and r["choices"][0]["text"] == text, r
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "allowed_token_ids": [0],
            "skip_special_tokens": False}
    status, r = _post(server, CHAT, chat)
    assert status == 200 and r["choices"][0]["message"]["content"] == "<|begin_of_text|>" * 2, r


def test_vllm_truncate_prompt_tokens_reads_the_prompt_end(server, long_ckpt):
    """truncate_prompt_tokens (vLLM's): the request reads its prompt's last k tokens, as the library does; the echo
    and the usage say so; 0 is a 400 naming the field."""
    llm = LLM(long_ckpt)
    ids = llm.get_tokenizer().encode("def f(x):\n    return x + 1")
    body = {"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True,
            "truncate_prompt_tokens": 4}
    want = llm.generate([{"prompt_token_ids": ids[-4:]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    lib = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                   truncate_prompt_tokens=4))
    assert lib[0].prompt_token_ids == ids[-4:] and lib[0].text == want[0].text
    status, r = _post(server, "/v1/completions", body)
    assert status == 200 and r["usage"]["prompt_tokens"] == 4, r
    assert r["choices"][0]["text"] == llm.get_tokenizer().decode(ids[-4:]) + want[0].text
    for value in (0, -2):
        status, r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": value})
        assert status == 400 and r["error"]["param"] == "truncate_prompt_tokens", r


def test_vllm_stop_token_ids_stop_strings_kept_and_guided_names(server, long_ckpt):
    """vLLM's extensions its clients send: stop_token_ids end the output at that token (as the library's
    SamplingParams.stop_token_ids) and min_tokens holds it back, include_stop_str_in_output keeps the stop string, and
    guided_choice / _regex / _json constrain as structured_outputs does (two at once: a 400 naming them). Each was
    dropped in silence."""
    llm = LLM(long_ckpt)
    greedy = dict(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate(["def f(x):"], SamplingParams(**greedy))[0]
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    stop_id = plain.token_ids[3]
    want = llm.generate(["def f(x):"], SamplingParams(**greedy, stop_token_ids=[stop_id]))[0]
    status, r = _post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id]})
    assert status == 200 and r["choices"][0]["text"] == want.text and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == len(want.token_ids) < 16
    held = llm.generate(["def f(x):"], SamplingParams(**greedy, stop_token_ids=[stop_id], min_tokens=6))[0]
    status, r = _post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id], "min_tokens": 6})
    assert status == 200 and r["choices"][0]["text"] == held.text and r["usage"]["completion_tokens"] >= 6
    for extra in ({"min_tokens": 17}, {"min_tokens": 2, "guided_choice": ["yes"]}):  # > max_tokens; with a grammar
        status, r = _post(server, "/v1/completions", {**body, **extra})
        assert status == 400 and r["error"]["param"] == "min_tokens", r
    stop = next(plain.text[i:i + 2] for i in range(len(plain.text) // 2, len(plain.text) - 2)
                if plain.text[i:i + 2].strip())  # two characters from the middle
    cut = plain.text.index(stop)
    for keep in (False, True):
        status, r = _post(server, "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": keep})
        assert status == 200 and r["choices"][0]["text"] == plain.text[:cut + (len(stop) if keep else 0)], r
    status, r = _post(server, "/v1/completions", {**body, "guided_choice": ["yes", "no"]})
    assert status == 200 and r["choices"][0]["text"] in ("yes", "no")
    status, r = _post(server, "/v1/completions", {**body, "guided_regex": "[0-9]{3}"})
    assert status == 200 and re.fullmatch("[0-9]{3}", r["choices"][0]["text"]), r
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    status, r = _post(server, "/v1/completions", {**body, "max_tokens": 32, "guided_json": schema})
    assert status == 200 and json.loads(r["choices"][0]["text"])["a"] in (1, 2), r
    status, r = _post(server, "/v1/completions", {**body, "guided_regex": "a", "guided_choice": ["b"]})
    assert status == 400 and r["error"]["param"].startswith("guided"), r
    status, r = _post(server, "/v1/completions", {**body, "stop_token_ids": [-1]})
    assert status == 400 and r["error"]["param"] == "stop_token_ids", r


def test_a_body_that_is_not_json_says_so(server):
    status, r = _post(server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in r["error"]["message"] and r["error"]["param"] is None
    status, r = _post(server, "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in r["error"]["message"]
    # curl -d's default type: the body is not read as JSON, and the answer names the header it needs
    form = "application/x-www-form-urlencoded"
    status, r = _post(server, "/v1/completions", {"model": NAME, "prompt": "hi"}, kind=form)
    assert status == 400 and "Content-Type: application/json" in r["error"]["message"] \
        and "x-www-form-urlencoded" in r["error"]["message"], r


def test_tiny_temperatures_are_greedy(server, long_ckpt):
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    want = LLM(long_ckpt).generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    status, r = _post(server, "/v1/completions", {"model": NAME, "prompt": "def f(x):", "max_tokens": 12,
                                                   "temperature": 1e-38, "ignore_eos": True})
    assert status == 200 and r["choices"][0]["text"] == want.text


def test_abandoned_non_streaming_requests_are_aborted_and_free_their_kv(server):
    eng = server.engine
    before = _aborted(server)
    body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 3000, "ignore_eos": True}).encode()

    def give_up():
        try:
            _post(server, "/v1/completions", body, timeout=0.5)
        except (TimeoutError, socket.timeout, urllib.error.URLError):
            pass

    clients = [threading.Thread(target=give_up) for _ in range(10)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    gone = time.monotonic()  # every client has closed its connection by now
    while not _kv_free(eng) and time.monotonic() - gone < 5:
        time.sleep(0.02)
    freed = time.monotonic() - gone
    assert _kv_free(eng) and not eng.engine.has_unfinished
    assert freed < 1.0, f"KV freed {freed:.2f} s after the clients left"
    assert _aborted(server) - before == 10


def _get(server, path):
    return urllib.request.urlopen(urllib.request.Request(server.url + path, headers={"authorization": f"Bearer {KEY}"}),
                                  timeout=10)


def _aborted(server) -> float:
    with _get(server, "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith('infer_requests_total{status="abort"}'):
                return float(line.split()[-1])
    return 0.0


def test_a_megabyte_prompt_does_not_stall_health(server):
    prompt = "def f(x): return x * 2  # " * 40000  # ~1 MB: tokenised in a worker thread, not on the event loop
    done, worst = threading.Event(), [0.0]

    def big():
        _post(server, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1}, timeout=120)
        done.set()

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.05)
    while not done.is_set():
        t0 = time.monotonic()
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert r.status == 200
        worst[0] = max(worst[0], time.monotonic() - t0)
        time.sleep(0.02)
    t.join()
    assert worst[0] < 0.25, f"/health took {worst[0]:.2f} s while a 1 MB prompt was tokenised"


def test_openapi_documents_what_the_server_sends(server):
    with _get(server, "/openapi.json") as r:
        schema = json.loads(r.read())
    comp = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in comp and {"400", "404", "413", "503"} <= set(comp)
    assert "text/event-stream" in comp["200"]["content"]
    assert "/metrics" in schema["paths"] and "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"][
        "content"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_within_the_grace_period_and_ends_every_stream(long_ckpt):
    grace, port = 1.0, _free_port()
    proc = start_server("--model", str(long_ckpt), "--port", str(port), "--max-batch-size", "8",
                        "--shutdown-timeout", str(grace), env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, server_log(proc)
                time.sleep(0.2)
        ends: list = [None] * 8
        body = json.dumps({"model": str(long_ckpt), "prompt": "x", "max_tokens": 3900, "ignore_eos": True,
                           "stream": True}).encode()

        def stream(i):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
            events = []
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
            last = json.loads(events[-2])["choices"][0]
            ends[i] = (events[-1], last["finish_reason"])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # all eight are streaming
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace + 10)
        took = time.monotonic() - t0
        for t in threads:
            t.join(timeout=5)
        assert took < grace + 2, f"exited {took:.1f} s after SIGTERM"
        assert ends == [(b"[DONE]", "abort")] * 8  # every stream got its final event, then [DONE]
    finally:
        stop_server(proc)
