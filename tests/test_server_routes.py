"""Each router alone: mounted on a bare FastAPI app over a stand-in engine and tokenizer (no model, no socket)."""

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from infer.engine import QueueFullError
from infer.request import StepOutput
from infer.server import completions, meta
from infer.server.errors import ApiKeyAuth, BodySizeLimit, install_error_handlers
from infer.server.metrics import ServerMetrics
from infer.server.state import ServerState

NAME = "tiny"
KEY = "k"


class CharTokenizer:
    """One token per character: a prompt's length in tokens is its length in characters."""

    has_chat_template = False

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ScriptedStream:
    """Streams ``reply`` one character per StepOutput, the last one finished by length."""

    def __init__(self, request_id, reply, finish="length"):
        self.outs = [StepOutput(request_id, ord(ch), ch, finished=i == len(reply) - 1,
                                finish_reason=finish if i == len(reply) - 1 else None)
                     for i, ch in enumerate(reply)]
        self.closed = self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outs:
            raise StopAsyncIteration
        out = self.outs.pop(0)
        self.finished = out.finished
        return out

    def close(self):
        self.closed = True


class FakeEngine:
    """AsyncEngine's surface the routes use: ``error`` and ``add_request``, which refuses after ``capacity`` adds."""

    def __init__(self, reply="ok!", capacity=100, finish="length"):
        self.reply, self.capacity, self.finish = reply, capacity, finish
        self.error = None
        self.added: list[tuple[list[int], object, ScriptedStream]] = []
        self.lora_modules, self.lora_loading = {}, False  # no LoRA adapters, none loaded while it runs

    async def add_request(self, prompt_ids, params, request_id, speculate=True):
        if len(self.added) >= self.capacity:
            raise QueueFullError("waiting queue full")
        stream = ScriptedStream(request_id, self.reply, self.finish)
        self.added.append((prompt_ids, params, stream))
        return stream


def fake_state(engine=None) -> ServerState:
    engine = engine or FakeEngine()
    return ServerState(engine=engine, served_model_name=NAME, metrics=ServerMetrics(engine),
                       tokenizer=CharTokenizer(), speculative=False, max_seq_len=64, vocab_size=0x110000)


def mount(router, state, api_key=None, max_body_bytes=None) -> TestClient:
    app = FastAPI()
    app.state.server = state
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    if max_body_bytes:
        app.add_middleware(BodySizeLimit, limit=max_body_bytes)
    app.include_router(router)
    return TestClient(app)


def assert_openai_error(r, status, type_, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == type_ and err["param"] == param and err["code"] == status and err["message"]


# -- meta: /health, /v1/models -----------------------------------------------------------------------------------

def test_models_lists_exactly_the_served_name():
    r = mount(meta.router, fake_state()).get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [NAME]


def test_version_is_the_packages():
    from infer import __version__

    assert mount(meta.router, fake_state()).get("/version").json() == {"version": __version__}


def test_model_card_is_the_served_name_only():
    client = mount(meta.router, fake_state())
    r = client.get(f"/v1/models/{NAME}")
    assert r.status_code == 200 and r.json()["id"] == NAME and r.json()["max_model_len"] == 64
    assert_openai_error(client.get("/v1/models/other"), 404, "not_found_error", "model")


def test_health_reports_a_dead_engine_loop():
    state = fake_state()
    client = mount(meta.router, state)
    assert client.get("/health").json() == {"status": "ok"}
    state.engine.error = RuntimeError("boom")
    assert_openai_error(client.get("/health"), 503, "server_error")


def test_auth_rejects_a_wrong_key_but_not_on_health():
    client = mount(meta.router, fake_state(), api_key=KEY)
    assert_openai_error(client.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401,
                        "authentication_error")
    assert_openai_error(client.get("/v1/models"), 401, "authentication_error")
    assert client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_unknown_route_is_an_openai_404():
    assert_openai_error(mount(meta.router, fake_state()).get("/v1/nothing"), 404, "not_found_error")


# -- completions -------------------------------------------------------------------------------------------------

def test_completion_answers_the_streamed_text_with_usage():
    state = fake_state()
    r = mount(completions.router, state).post("/v1/completions", json={"model": NAME, "prompt": "abcd", "n": 2,
                                                                       "seed": 5, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["abcdok!", "abcdok!"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 6  # one prompt, n=2
    assert body["usage"]["acceptance_rate"] is None  # no drafter
    assert [params.seed for _, params, _ in state.engine.added] == [5, 6]  # choice j gets seed + j
    assert state.engine.added[0][0] == [ord(ch) for ch in "abcd"]
    assert all(stream.closed for _, _, stream in state.engine.added)


def test_completion_streams_sse_ending_with_usage_and_done():
    client = mount(completions.router, fake_state())
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "ab", "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "ok!"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("n", 0), ("prompt", None)])
def test_completion_validation_names_the_bad_parameter(field, value):
    state = fake_state()
    body = {"model": NAME, "prompt": "x", field: value}
    if value is None:
        del body[field]
    assert_openai_error(mount(completions.router, state).post("/v1/completions", json=body), 400,
                        "invalid_request_error", field)
    assert state.engine.added == []


def test_sampling_params_refusal_names_the_field_and_counts_as_rejected():
    state = fake_state()
    r = mount(completions.router, state).post("/v1/completions", json={"model": NAME, "prompt": "x", "stop": [""]})
    assert_openai_error(r, 400, "invalid_request_error", "stop")
    assert state.metrics.registry.get_sample_value("infer_requests_total", {"status": "rejected"}) == 1


def test_unknown_model_is_404_naming_model():
    r = mount(completions.router, fake_state()).post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert_openai_error(r, 404, "not_found_error", "model")


def test_full_queue_is_503_with_retry_after_and_closes_what_was_admitted():
    state = fake_state(FakeEngine(capacity=1))
    r = mount(completions.router, state).post("/v1/completions", json={"model": NAME, "prompt": "x", "n": 2})
    assert_openai_error(r, 503, "server_error")
    assert r.headers["retry-after"] == "1"
    [(_, _, admitted)] = state.engine.added
    assert admitted.closed  # the first of n=2 got in; the refusal must abort it, not leave it running


def test_chat_without_template_is_400_naming_messages():
    r = mount(completions.router, fake_state()).post(
        "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(r, 400, "invalid_request_error", "messages")


def test_body_size_limit_answers_413_before_the_route():
    state = fake_state()
    client = mount(completions.router, state, max_body_bytes=64)
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "x" * 100})
    assert_openai_error(r, 413, "invalid_request_error")
    assert state.engine.added == []


# -- tool calls read by a parser ----------------------------------------------------------------------------------

class ChatTokenizer(CharTokenizer):
    """A chat template that shows the model its tools: the rendering is the messages and tools as JSON."""

    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False, tools=None):
        return self.encode(json.dumps([messages, tools]))


HERMES_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'


@pytest.mark.parametrize("parser, reply, content, calls", [
    ("hermes", HERMES_REPLY, "Checking.", [("get_weather", '{"city":"Paris"}')]),
    ("hermes", "No tool needed.\n", "No tool needed.\n", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city":"Oslo"}')]),
])
def test_auto_tool_choice_reads_the_models_calls_streamed_or_not(parser, reply, content, calls):
    state = fake_state(FakeEngine(reply, finish="stop"))
    state.tokenizer, state.tool_parser = ChatTokenizer(), parser
    client = mount(completions.router, state)
    body = {"model": NAME, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", [])] \
        == calls
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
    seen = json.loads(state.tokenizer.decode(state.engine.added[0][0]))[1]  # the template saw them, every field set
    assert [t["function"]["name"] for t in seen] == ["get_weather"] and seen[0]["function"]["parameters"] is None
    assert state.engine.added[0][1].structured is None  # "auto" constrains nothing
    events = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    sent = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in sent] == calls
    assert [c["index"] for c in sent] == list(range(len(calls))) and all(c["id"].startswith("call_") for c in sent)
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


@pytest.mark.parametrize("reply, blocks", [
    (HERMES_REPLY, [{"type": "text", "text": "Checking."}, {"type": "tool_use", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]),
    ("No tool needed.\n", [{"type": "text", "text": "No tool needed.\n"}]),
])
def test_anthropic_auto_tool_choice_answers_text_and_tool_use_blocks(reply, blocks):
    """/v1/messages with tools and a parser: the model's text and calls as text and tool_use blocks in the order
    written, stop_reason tool_use when it called; streamed, the same blocks from the block events."""
    from infer.server import messages

    state = fake_state(FakeEngine(reply, finish="stop"))
    state.tokenizer, state.tool_parser, state.max_seq_len = ChatTokenizer(), "hermes", 512
    client = mount(messages.router, state)
    body = {"model": NAME, "max_tokens": 60, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [{k: v for k, v in b.items() if k != "id"} for b in got["content"]] == blocks
    assert all(b["id"].startswith("toolu_") for b in got["content"] if b["type"] == "tool_use")
    assert got["stop_reason"] == ("tool_use" if len(blocks) > 1 else "end_turn")
    seen = json.loads(state.tokenizer.decode(state.engine.added[0][0]))[1]  # the template saw the tool
    assert [t["function"]["name"] for t in seen] == ["get_weather"]
    events = [json.loads(line[6:]) for line in client.post("/v1/messages", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: ")]
    built, args = [], {}
    for e in events:
        if e["type"] == "content_block_start":
            built.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            built[e["index"]]["text"] += e["delta"]["text"]
        elif e["type"] == "content_block_delta":
            args[e["index"]] = args.get(e["index"], "") + e["delta"]["partial_json"]
    for i, text in args.items():
        built[i]["input"] = json.loads(text)
    assert [{k: v for k, v in b.items() if k != "id"} for b in built] == blocks
    assert [e["type"] for e in events].count("content_block_stop") == len(blocks)
    assert events[-2]["delta"]["stop_reason"] == got["stop_reason"]
