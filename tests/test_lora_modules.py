"""Per-request LoRA adapters (EngineConfig.lora_modules, vLLM's --lora-modules): each request picks an adapter by name,
requests of several adapters and of none share a batch, and each gets what an engine of its adapter alone gives;
a row's tokens do not depend on its neighbours (so speculation stays plain decoding); the prefix cache never hands
one adapter's K/V to another; the server answers to each adapter's name as a model id."""

import json
import urllib.request

import openai
import pytest

from infer import LLM, LoRARequest, SamplingParams
from infer.engine import EngineConfig
from infer.engine.async_engine import AsyncEngine
from infer.model.llama import LlamaForCausalLM
from infer.server import build_app
from infer.server.thread import ServerThread
from test_lora import write_adapter

PROMPTS = ["def fib(n):", "hello world, hello again", "the quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SETTINGS = [dict(dtype="float32"), dict(dtype="bfloat16", quantization="q4_1")]


@pytest.fixture(scope="module")
def adapters(gqa_dir, tmp_path_factory):
    """Two adapters that disagree with each other and with the base: one on every projection, one on q and v only
    (so some products carry one adapter's columns alone)."""
    root = tmp_path_factory.mktemp("loras")
    return {"sql": write_adapter(root / "sql", gqa_dir, seed=1),
            "chat": write_adapter(root / "chat", gqa_dir, ("q_proj", "v_proj"), r=8, seed=2, b_std=0.6)}


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_request_gets_its_adapters_tokens_in_a_mixed_batch(gqa_dir, adapters, setting, monkeypatch):
    """A batch of three rows (two adapters and the base) gives each row the tokens it gets alone, bit for bit (a
    row's sum runs over every adapter's columns on either path, the others' terms exactly 0; bfloat16 Q4_1: a lone
    row's steps are one C++ call with its adapter's products, the batch's steps the masked products), and in float32
    the tokens an engine with that adapter on every request gives (its products r-wide, here a few columns wider:
    the same sums to float32's rounding)."""
    picks = ["sql", "chat", None]
    llm = LLM(gqa_dir, lora_modules={k: str(v) for k, v in adapters.items()}, max_batch_size=3, block_size=4,
              **setting)
    batched = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=picks))
    native = []
    orig = LlamaForCausalLM._native_forward
    monkeypatch.setattr(LlamaForCausalLM, "_native_forward", lambda *a: native.append(a[-1]) or orig(*a))
    for i, name in enumerate(picks):  # each alone; a LoRARequest as vLLM's callers write it
        req = LoRARequest(name, i + 1, str(adapters[name])) if name else None
        assert _tokens(llm.generate(PROMPTS[i:i + 1], GREEDY, lora_request=req)) == [batched[i]]
    assert sorted(set(native)) == ([0, 1, 2] if "quantization" in setting else [])  # each row its own adapter
    # the adapters change the answers: each prompt under each pick differs from the base's
    for name in ("sql", "chat"):
        assert all(a != b for a, b in zip(_tokens(llm.generate(PROMPTS, GREEDY, lora_request=name)),
                                          _tokens(llm.generate(PROMPTS, GREEDY))))
    if setting["dtype"] == "float32":
        for i, name in enumerate(picks):
            one = LLM(gqa_dir, lora=None if name is None else str(adapters[name]), max_batch_size=3, block_size=4,
                      **setting)
            assert _tokens(one.generate(PROMPTS[i:i + 1], GREEDY)) == [batched[i]]


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_speculation_with_per_request_adapters_is_plain_decoding(gqa_dir, adapters, setting):
    """The drafter knows nothing of the adapters; the target verifies each row with its own, so a speculating engine
    gives plain decoding's tokens row for row, batched and alone."""
    mods = {k: str(v) for k, v in adapters.items()}
    picks = ["chat", None, "sql"]
    plain = LLM(gqa_dir, lora_modules=mods, max_batch_size=3, block_size=4, **setting)
    want = _tokens(plain.generate(PROMPTS, GREEDY, lora_request=picks))
    spec = LLM(gqa_dir, lora_modules=mods, draft_model=gqa_dir, spec_length=3, max_batch_size=3, block_size=4,
               **setting)
    assert _tokens(spec.generate(PROMPTS, GREEDY, lora_request=picks)) == want
    assert _tokens(spec.generate(PROMPTS[:1], GREEDY, lora_request=picks[:1])) == want[:1]
    stats = spec.engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_prefix_cache_keeps_each_adapters_prefixes_apart(gqa_dir, adapters):
    """A prompt's K/V depends on the adapter that computed it: the same prompt under another adapter (or none)
    computes its own, and finds it again under the same one."""
    llm = LLM(gqa_dir, dtype="float32", lora_modules={k: str(v) for k, v in adapters.items()}, block_size=4,
              enable_prefix_caching=True)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    cached = [llm.generate([prompt], GREEDY, lora_request=name)[0].num_cached_tokens
              for name in (None, "sql", "chat", "sql", "chat", None)]
    assert cached[:3] == [0, 0, 0] and min(cached[3:]) > 0


def test_adapters_are_checked_by_name(gqa_dir, adapters, tmp_path):
    mods = {k: str(v) for k, v in adapters.items()}
    llm = LLM(gqa_dir, dtype="float32", lora_modules=mods)
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'sq1': this engine's adapters are \['sql', 'chat'\]"):
        llm.generate(PROMPTS, GREEDY, lora_request=["sql", "sq1", None])
    assert not llm.engine.has_unfinished  # nothing of the call was queued
    with pytest.raises(ValueError, match="got 2 lora_requests for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, lora_request=["sql", None])
    with pytest.raises(ValueError, match="this engine loads none"):
        LLM(gqa_dir, dtype="float32").generate(PROMPTS[:1], GREEDY, lora_request="sql")
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig(model=str(gqa_dir), lora=mods["sql"], lora_modules=mods)
    with pytest.raises(ValueError, match=r"lora_modules\['x'\] must be a PEFT adapter's directory"):
        EngineConfig(model=str(gqa_dir), lora_modules={"x": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="adapter names must be non-empty"):
        EngineConfig(model=str(gqa_dir), lora_modules={" ": mods["sql"]})


def test_the_server_answers_to_each_adapters_name(gqa_dir, adapters):
    """`infer serve --lora-modules sql=... chat=...`: /v1/models lists the base model and each adapter (its parent
    and directory); a completion asked of an adapter's id is the library's answer with that adapter; the pooling
    routes, which run the base model, say so; an unknown id is a 404 naming the ids there are."""
    from infer.server.__main__ import add_serve_args, engine_config
    import argparse

    p = argparse.ArgumentParser()
    add_serve_args(p)
    a = p.parse_args(["--model", str(gqa_dir), "--dtype", "float32", "--lora-modules", f"sql={adapters['sql']}",
                      f"chat={adapters['chat']}"])
    cfg = engine_config(a)
    assert cfg.lora_modules == {"sql": str(adapters["sql"]), "chat": str(adapters["chat"])}
    with pytest.raises(ValueError, match="names 'sql' more than once"):
        engine_config(p.parse_args(["--model", str(gqa_dir), "--lora-modules", f"sql={adapters['sql']}",
                                    f"sql={adapters['chat']}"]))
    for bad in ("sql", '{"name": "sql"}'):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", str(gqa_dir), "--lora-modules", bad])
    as_json = json.dumps({"name": "sql", "path": str(adapters["sql"]), "base_model_name": "x"})  # vLLM's JSON form
    assert engine_config(p.parse_args(["--model", str(gqa_dir), "--lora-modules", as_json])).lora_modules == {
        "sql": str(adapters["sql"])}
    engine = AsyncEngine(cfg)
    try:
        with pytest.raises(ValueError, match="also a LoRA adapter's"):
            build_app(engine, "sql")
        with ServerThread(build_app(engine, "tiny")) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
            cards = {m.id: m for m in client.models.list().data}
            assert list(cards) == ["tiny", "sql", "chat"]
            assert cards["sql"].model_extra["parent"] == "tiny"
            assert cards["chat"].model_extra["root"] == str(adapters["chat"])
            assert client.models.retrieve("chat").id == "chat"
            llm = LLM(gqa_dir, dtype="float32", lora_modules=cfg.lora_modules)
            for name in ("sql", "chat", "tiny"):
                want = llm.generate(PROMPTS[:1], GREEDY, lora_request=None if name == "tiny" else name)
                got = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert got.choices[0].text == want[0].outputs[0].text and got.model == name
            # the chat and Responses routes too: the library's chat answer with that adapter
            talk = [{"role": "user", "content": "Say something."}]
            ref = llm.chat(talk, SamplingParams(temperature=0, max_tokens=8), lora_request="sql").outputs[0].text
            chat = client.chat.completions.create(model="sql", messages=talk, max_tokens=8, temperature=0)
            assert chat.choices[0].message.content == ref and chat.model == "sql"
            resp = client.responses.create(model="sql", input="Say something.", max_output_tokens=8, temperature=0)
            assert resp.output_text == ref
            from infer.beam import BeamSearchParams

            beams = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4), lora_request="chat")
            got = client.completions.create(model="chat", prompt=PROMPTS[0], max_tokens=4, n=2,
                                            extra_body={"use_beam_search": True})
            assert [c.text for c in got.choices] == [s.text for s in beams[0].sequences]
            with pytest.raises(openai.BadRequestError, match="runs the base model"):
                client.embeddings.create(model="sql", input="hello")
            with pytest.raises(openai.NotFoundError, match="this server serves 'tiny', 'sql', 'chat'"):
                client.completions.create(model="sq1", prompt="x", max_tokens=1)
            with urllib.request.urlopen(srv.url + "/openapi.json") as r:
                schema = json.load(r)
            enum = schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"]
            assert enum == ["tiny", "sql", "chat"]
    finally:
        engine.shutdown()


def test_a_compiled_engine_builds_the_adapter_steps_at_start_up(gqa_dir, adapters):
    """Rows with an adapter read AttnMeta.adapters, a graph of their own: the warm-up builds them beside the base's,
    so a mixed batch and a lone adapter row after it run compiled without stopping to compile, with the eager
    engine's tokens."""
    import torch

    mods = {k: str(v) for k, v in adapters.items()}
    picks = ["sql", None, "chat"]
    eager = _tokens(LLM(gqa_dir, lora_modules=mods, max_batch_size=2, block_size=4).generate(
        PROMPTS, GREEDY, lora_request=picks))
    llm = LLM(gqa_dir, lora_modules=mods, compile=True, max_batch_size=2, block_size=4)  # decode graphs only
    assert llm.engine.wait_until_ready(timeout=600)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=picks)) == eager
        assert _tokens(llm.generate(PROMPTS[2:], GREEDY, lora_request="chat")) == eager[2:]


def test_a_beam_search_takes_an_adapter(gqa_dir, adapters):
    """LLM.beam_search's steps are engine requests: with lora_request they are the adapter's, the beams those of an
    engine with that adapter on every request."""
    from infer.beam import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=6)
    llm = LLM(gqa_dir, dtype="float32", lora_modules={k: str(v) for k, v in adapters.items()})
    got = [s.token_ids for s in llm.beam_search(PROMPTS[0], params, lora_request="sql")[0].sequences]
    one = LLM(gqa_dir, dtype="float32", lora=str(adapters["sql"]))
    assert got == [s.token_ids for s in one.beam_search(PROMPTS[0], params)[0].sequences]
    assert got != [s.token_ids for s in llm.beam_search(PROMPTS[0], params)[0].sequences]
    with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
        llm.beam_search(PROMPTS[0], params, lora_request="x")
