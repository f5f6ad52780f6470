"""llama.cpp's own server routes on a speculating engine: /completion's greedy answer is the library's (text, token-id
and mixed prompts, several prompts, a stop word, a JSON schema, n_probs), streamed as llama-server streams it, with
llama.cpp's account (stop_type, tokens_cached, timings with the drafts); what means something else here is a 400
naming it; /props, /slots, /apply-template, and /tokenize and /detokenize in llama.cpp's shape."""

import json
import urllib.error
import urllib.request

import jsonschema
import pytest

from infer import LLM, SamplingParams
from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.server import build_app
from infer.server.thread import ServerThread

NAME = "tiny"
PROMPT = "def fib(n):"
GREEDY = {"temperature": 0, "n_predict": 10}


@pytest.fixture(scope="module")
def server(ckpt_dirs):
    engine = AsyncEngine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=3,
                                      max_batch_size=2, block_size=4, enable_prefix_caching=True))
    with ServerThread(build_app(engine, NAME)) as srv:
        yield srv
    engine.shutdown()


class _Answer:
    def __init__(self, status: int, body: bytes):
        self.status_code, self.text = status, body.decode()

    def json(self):
        return json.loads(self.text)


class _Http:
    """POST / GET JSON to the server (urllib: no HTTP client beyond the standard library's needed)."""

    def __init__(self, url):
        self.url = url

    def _send(self, path, body=None) -> _Answer:
        req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return _Answer(r.status, r.read())
        except urllib.error.HTTPError as e:
            return _Answer(e.code, e.read())

    def post(self, path, json):
        return self._send(path, json)

    def get(self, path):
        return self._send(path)

    def lines(self, path, json) -> list[dict]:
        """A stream's data lines, as they come."""
        return [__import__("json").loads(line[6:]) for line in self._send(path, json).text.splitlines()
                if line.startswith("data: ")]


@pytest.fixture(scope="module")
def http(server):
    return _Http(server.url)


@pytest.fixture(scope="module")
def llm(ckpt_dirs):
    return LLM(ckpt_dirs["gqa"])


def _ref(llm, prompt, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 10, **kw})
    if isinstance(prompt, list):
        return llm.generate({"prompt_token_ids": prompt}, params)[0]
    return llm.generate([prompt], params)[0]


def test_completion_is_the_librarys_answer_with_llama_cpps_account(http, llm):
    ref = _ref(llm, PROMPT)
    r = http.post("/completion", json={"prompt": PROMPT, **GREEDY, "return_tokens": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["content"] == ref.outputs[0].text and got["tokens"] == ref.outputs[0].token_ids
    assert got["stop"] is True and got["stop_type"] == ("limit" if ref.finish_reason == "length" else "eos")
    assert got["tokens_evaluated"] == len(ref.prompt_token_ids) and got["tokens_predicted"] == len(got["tokens"])
    assert got["generation_settings"]["n_ctx"] == llm.engine.max_seq_len and got["model"] == NAME
    t = got["timings"]
    assert t["predicted_n"] == got["tokens_predicted"] and t["prompt_n"] + t["cache_n"] == got["tokens_evaluated"]
    assert t["draft_n"] >= t["draft_n_accepted"] >= 0 and t["draft_n"] > 0  # the drafter ran
    # the same prompt as ids, and as ids and text mixed
    ids = ref.prompt_token_ids
    assert http.post("/completion", json={"prompt": ids, **GREEDY}).json()["content"] == ref.outputs[0].text
    cut = len(llm.get_tokenizer().encode("def"))
    mixed = ids[:cut] + [PROMPT[3:]]
    want = _ref(llm, ids[:cut] + llm.get_tokenizer().encode(PROMPT[3:], add_special_tokens=False)).outputs[0].text
    assert http.post("/completions", json={"prompt": mixed, **GREEDY}).json()["content"] == want
    # several prompts: a list of answers
    many = http.post("/completion", json={"prompt": [PROMPT, "Hello"], **GREEDY}).json()
    assert [a["content"] for a in many] == [ref.outputs[0].text, _ref(llm, "Hello").outputs[0].text]
    assert [a["index"] for a in many] == [0, 1]


def test_streamed_completion_is_llama_servers_lines(http, llm):
    ref = _ref(llm, PROMPT)
    *pieces, last = http.lines("/completion", {"prompt": PROMPT, **GREEDY, "n_probs": 2, "stream": True})
    assert all(p["stop"] is False for p in pieces) and last["stop"] is True and last["content"] == ""
    assert "".join(p["content"] for p in pieces) == ref.outputs[0].text
    assert [t for p in pieces for t in p["tokens"]] == ref.outputs[0].token_ids[:sum(len(p["tokens"]) for p in pieces)]
    probs = [e for p in pieces for e in p["completion_probabilities"]]
    assert [e["id"] for e in probs] == [t for p in pieces for t in p["tokens"]]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["id"] == e["id"] for e in probs)  # greedy: top
    assert last["tokens_predicted"] == len(ref.outputs[0].token_ids) and last["timings"]["predicted_n"] > 0


def test_a_stop_word_and_a_schema(http, llm):
    free = _ref(llm, PROMPT, max_tokens=16).outputs[0].text
    word = free.strip()[2:5]
    assert word and word in free
    got = http.post("/completion", json={"prompt": PROMPT, "temperature": 0, "n_predict": 16, "stop": [word]}).json()
    assert (got["stop_type"], got["stopping_word"]) == ("word", word)
    assert got["content"] == _ref(llm, PROMPT, max_tokens=16, stop=[word]).outputs[0].text
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    got = http.post("/completion", json={"prompt": PROMPT, "temperature": 0, "n_predict": 40, "json_schema": schema})
    jsonschema.validate(json.loads(got.json()["content"]), schema)
    assert got.json()["content"] == _ref(llm, PROMPT, max_tokens=40, structured={"json_schema": schema}).outputs[0].text


def test_n_predict_zero_answers_nothing_and_warms_the_cache(http):
    prompt = "A prompt to keep: " + "x " * 20
    got = http.post("/completion", json={"prompt": prompt, "n_predict": 0}).json()
    assert got["content"] == "" and got["tokens_predicted"] == 0 and got["stop_type"] == "limit"
    again = http.post("/completion", json={"prompt": prompt, **GREEDY}).json()
    assert again["tokens_cached"] > 0


@pytest.mark.parametrize("change, param, words", [
    ({"repeat_penalty": 1.1}, "repeat_penalty", "repeat_last_n -1"),
    ({"presence_penalty": 0.5}, "presence_penalty", "/v1/completions"),
    ({"mirostat": 2}, "mirostat", "Mirostat"),
    ({"samplers": ["top_k", "temperature"]}, "samplers", "sampler order"),
    ({"typical_p": 0.9}, "typical_p", "typical"),
    ({"logit_bias": [["Hello", -1.0]]}, "logit_bias", "text keys"),
    ({"grammar": "root ::= \"a\"", "json_schema": {}}, "grammar", "not both"),
    ({"prompt": "x " * 5000}, "prompt", "fills the context"),
    ({"prompt": []}, "prompt", "empty"),
])
def test_what_means_something_else_here_is_refused_by_name(http, change, param, words):
    r = http.post("/completion", json={"prompt": PROMPT, **GREEDY, **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and param in (err["param"] or err["message"]), err


def test_logit_bias_false_bans_a_token(http, llm):
    first = _ref(llm, PROMPT).outputs[0].token_ids[0]
    got = http.post("/completion", json={"prompt": PROMPT, **GREEDY, "return_tokens": True,
                                         "logit_bias": [[first, False]]}).json()
    assert got["tokens"][0] != first
    assert http.post("/completion", json={"prompt": PROMPT, **GREEDY, "return_tokens": True,
                                          "logit_bias": {str(first): False}}).json()["tokens"][0] != first


def test_props_apply_template_tokenize_detokenize(http, llm):
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == llm.engine.max_seq_len
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8 and props["total_slots"] == 2
    assert props["chat_template"] and props["model_alias"] == NAME
    n_ctx = llm.engine.max_seq_len
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in http.get("/slots").json()] == [(0, n_ctx, False),
                                                                                               (1, n_ctx, False)]
    msgs = [{"role": "user", "content": "Hi there"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=1)).prompt_token_ids
    tok = llm.get_tokenizer()
    assert http.post("/apply-template", json={"messages": msgs}).json()["prompt"] == tok.decode(want)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert http.post("/tokenize", json={"content": "Hello world"}).json() == {"tokens": ids}
    pieces = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == "Hello world"
    special = tok.decode([llm.engine.tokenizer.hf.eos_token_id], skip_special_tokens=False)
    assert len(http.post("/tokenize", json={"content": special}).json()["tokens"]) == 1
    assert len(http.post("/tokenize", json={"content": special, "parse_special": False}).json()["tokens"]) > 1
    out = http.post("/detokenize", json={"tokens": ids}).json()
    assert out["content"] == out["prompt"] == "Hello world"
