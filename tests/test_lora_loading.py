"""LoRA adapters loaded while the engine runs (vLLM's enable_lora / max_loras / max_lora_rank, a LoRARequest with a
path, /v1/load_lora_adapter and /v1/unload_lora_adapter): an adapter loaded into a slot gives the tokens of the same
adapter loaded at start, a slot emptied and filled again serves the new adapter (never the old one's cached K/V), a
compiled engine reads a new adapter without compiling again, and every refusal names its reason."""

import json
import urllib.error
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
    """Three adapters that disagree: every projection (r 4), q and v only (r 8), the MLP only (r 16)."""
    root = tmp_path_factory.mktemp("loras")
    return {"sql": write_adapter(root / "sql", gqa_dir, seed=1),
            "chat": write_adapter(root / "chat", gqa_dir, ("q_proj", "v_proj"), r=8, seed=2, b_std=0.6),
            "big": write_adapter(root / "big", gqa_dir, ("gate_proj", "up_proj", "down_proj"), r=16, seed=3)}


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _req(adapters, name):
    return LoRARequest(name, 1, str(adapters[name])) if name else None


@pytest.mark.parametrize("setting", SETTINGS)
def test_an_adapter_loaded_by_its_request_gives_the_tokens_of_one_loaded_at_start(gqa_dir, adapters, setting,
                                                                                   monkeypatch):
    """vLLM's library idiom: LLM(enable_lora=True), then lora_request=LoRARequest(name, id, path) loads the adapter
    on first use. A mixed batch gives each row its lone tokens bit for bit (a lone bfloat16 Q4_1 row through the
    one-call forward with its slot's products), and the tokens of an engine whose slots were filled at start; in
    float32 also those of the adapters stacked as loaded (lora_modules without enable_lora)."""
    picks = ["sql", "chat", None]
    kw = dict(max_batch_size=3, block_size=4, **setting)
    llm = LLM(gqa_dir, enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
    assert llm.engine.lora_names == [] and "loras: none of 2 slots" in llm.describe()
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[_req(adapters, x) for x in picks])
    batched = _tokens(outs)
    assert llm.engine.lora_names == ["sql", "chat"]
    assert [o.lora_request for o in outs] == [LoRARequest("sql", 1, str(adapters["sql"])),
                                              LoRARequest("chat", 2, str(adapters["chat"])), None]
    native = []
    orig = LlamaForCausalLM._native_forward
    monkeypatch.setattr(LlamaForCausalLM, "_native_forward", lambda *a: native.append(a[-1]) or orig(*a))
    for i, name in enumerate(picks):
        assert _tokens(llm.generate(PROMPTS[i:i + 1], GREEDY, lora_request=name)) == [batched[i]]
    assert sorted(set(native)) == ([0, 1, 2] if "quantization" in setting else [])
    base = _tokens(llm.generate(PROMPTS[:2], GREEDY))
    assert batched[0] != base[0] and batched[1] != base[1]  # the adapters change the answers
    mods = {k: str(adapters[k]) for k in ("sql", "chat")}
    at_start = LLM(gqa_dir, enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=mods, **kw)
    assert _tokens(at_start.generate(PROMPTS, GREEDY, lora_request=picks)) == batched
    # each slot written over with the other's adapter: a lone row (the one-call forward's per-adapter arguments
    # made afresh) gets what an engine loaded that way at start gives
    swapped = LLM(gqa_dir, enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={
        "sql": mods["chat"], "chat": mods["sql"]}, **kw)
    llm.engine.load_lora("sql", mods["chat"], replace=True)
    llm.engine.load_lora("chat", mods["sql"], replace=True)
    for i, name in enumerate(picks[:2]):
        got = _tokens(llm.generate(PROMPTS[i:i + 1], GREEDY, lora_request=name))
        assert got == _tokens(swapped.generate(PROMPTS[i:i + 1], GREEDY, lora_request=name)) != [batched[i]]
    if setting["dtype"] == "float32":
        stacked = LLM(gqa_dir, lora_modules=mods, **kw)
        assert _tokens(stacked.generate(PROMPTS, GREEDY, lora_request=picks)) == batched


def test_slots_are_reused_and_the_prefix_cache_never_serves_a_former_adapters_kv(gqa_dir, adapters):
    """One slot: each LoRARequest naming another adapter unloads the last one loaded that way (least recently used,
    idle) and loads its own; an adapter loaded again gives its first tokens. The same prompt under the adapter now
    in the slot computes its own K/V (each load salts the cache anew), and finds it again while that adapter stays."""
    llm = LLM(gqa_dir, dtype="float32", enable_lora=True, max_loras=1, block_size=4, enable_prefix_caching=True)
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    first = llm.generate([prompt], GREEDY, lora_request=_req(adapters, "sql"))[0]
    assert first.num_cached_tokens == 0 and llm.engine.lora_names == ["sql"]
    again = llm.generate([prompt], GREEDY, lora_request=_req(adapters, "sql"))[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate([prompt], GREEDY, lora_request=_req(adapters, "chat"))[0]
    assert llm.engine.lora_names == ["chat"] and other.num_cached_tokens == 0  # same slot, not sql's K/V
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    back = llm.generate([prompt], GREEDY, lora_request=_req(adapters, "sql"))[0]
    assert back.num_cached_tokens == 0 and back.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0  # the base model's own
    with pytest.raises(ValueError, match=r"all max_cpu_loras=1 adapters are loaded \(sql\): .*raise max_cpu_loras"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[_req(adapters, "chat"), _req(adapters, "sql")])
    assert not llm.engine.has_unfinished


def test_load_and_unload_refuse_by_name_and_keep_what_was_accepted(gqa_dir, adapters, tmp_path):
    eng = LLM(gqa_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8).engine
    with pytest.raises(ValueError, match=r"rank 16 \(down_proj\) is above this engine's max_lora_rank 8"):
        eng.load_lora("big", adapters["big"])
    with pytest.raises(ValueError, match="is not a PEFT adapter's directory"):
        eng.load_lora("x", tmp_path / "missing")
    with pytest.raises(ValueError, match="non-empty string without outer spaces"):
        eng.load_lora(" x", adapters["sql"])
    assert eng.lora_names == []
    eng.load_lora("sql", adapters["sql"])
    with pytest.raises(ValueError, match="named 'sql' is loaded already"):
        eng.load_lora("sql", adapters["chat"])
    req = eng.add_request(eng.tokenizer.encode(PROMPTS[0]), GREEDY, lora="sql")
    with pytest.raises(ValueError, match=r"'sql' is in use by 1 unfinished request\(s\)"):
        eng.unload_lora("sql")
    with pytest.raises(ValueError, match="in use by 1 unfinished"):
        eng.load_lora("sql", adapters["chat"], replace=True)
    eng.run([req])
    want = req.output_ids
    eng.load_lora("sql", adapters["chat"], replace=True)  # now idle: chat's weights under sql's name
    eng.load_lora("chat", adapters["chat"])
    with pytest.raises(ValueError, match=r"all max_cpu_loras=2 adapters are loaded \(sql, chat\)"):
        eng.load_lora("third", adapters["sql"])
    as_chat = [eng.add_request(eng.tokenizer.encode(PROMPTS[0]), GREEDY, lora=x) for x in ("sql", "chat")]
    eng.run(as_chat)
    assert as_chat[0].output_ids == as_chat[1].output_ids != want
    eng.unload_lora("sql")
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'sql': this engine's adapters are \['chat'\]"):
        eng.unload_lora("sql")
    plain = LLM(gqa_dir, dtype="float32", lora_modules={"sql": str(adapters["sql"])})
    with pytest.raises(ValueError, match="loads adapters at start only"):
        plain.engine.load_lora("chat", adapters["chat"])
    with pytest.raises(ValueError, match="is not loaded and this engine loads adapters at start only"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=_req(adapters, "chat"))
    with pytest.raises(ValueError, match="is loaded from .*, this request names"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("sql", 1, str(adapters["chat"])))
    with pytest.raises(ValueError, match="with two directories"):
        plain.generate(PROMPTS[:2], GREEDY, lora_request=[LoRARequest("x", 1, str(adapters["sql"])),
                                                          LoRARequest("x", 1, str(adapters["chat"]))])
    for bad, why in ((dict(max_loras=0), "max_loras must be an integer >= 1"),
                     (dict(max_lora_rank=True), "max_lora_rank must be an integer >= 1"),
                     (dict(lora=str(adapters["sql"])), "exclude each other"),
                     (dict(lora_modules={k: str(v) for k, v in adapters.items()}), "names 3 adapters, max_cpu_loras is 1"),
                     (dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be at least max_loras \(2\)"),
                     (dict(max_cpu_loras=0), "max_cpu_loras must be an integer >= 1")):
        with pytest.raises(ValueError, match=why):
            EngineConfig(model=str(gqa_dir), enable_lora=True, **bad)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculating"])
def test_more_adapters_than_slots_wait_for_one_and_keep_their_tokens(gqa_dir, adapters, spec, monkeypatch):
    """vLLM's max_cpu_loras: three adapters loaded, one slot. A request whose adapter is in no slot waits while another
    adapter's request runs, and the requests behind it go on (the base model's row decodes beside sql's); no step
    mixes two adapters; every row gets the tokens of an engine that holds all of them in slots. An adapter moved out
    of the slot and back finds its own cached K/V again (the same load: the same salt, the same weights)."""
    kw = dict(dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4, max_batch_size=4)
    if spec:
        kw.update(draft_model=str(gqa_dir), spec_length=3)
    llm = LLM(gqa_dir, max_loras=1, max_cpu_loras=3, **kw)
    assert "loras: none of 1 slots, 3 loaded at most" in llm.describe()
    picks = ["sql", "chat", None, "sql"]
    prompts = PROMPTS + ["def fib(n): return"]
    slotted = LLM(gqa_dir, max_loras=2, lora_modules={k: str(adapters[k]) for k in ("sql", "chat")}, **kw)
    want = [_tokens(slotted.generate([p], GREEDY, lora_request=x))[0] for p, x in zip(prompts, picks)]
    steps = []
    forward = llm.engine.runner.forward

    def spy(model, pool, slots, rows, tree=None, reqs=None):
        if reqs is not None and model is llm.engine.model:
            steps.append({r.lora_name for r in reqs})
        return forward(model, pool, slots, rows, tree, reqs)
    llm.engine.runner.forward = spy
    outs = llm.generate(prompts, GREEDY, lora_request=[_req(adapters, x) for x in picks])
    assert _tokens(outs) == want
    assert all(len(s - {None}) <= 1 for s in steps)  # one adapter a step: the one slot
    assert {"sql", None} in steps and {"chat"} in steps  # the base row went on beside sql; chat ran after
    assert llm.engine.lora_names == ["sql", "chat"]
    from types import SimpleNamespace

    from infer.server.metrics import ServerMetrics

    scrape = ServerMetrics(SimpleNamespace(engine=llm.engine))  # what /metrics reads: who waits for a slot
    queued = [llm.engine.add_request([5, 6, 7], GREEDY, lora=x) for x in ("chat", None, "sql")]
    assert 'infer_lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters="chat,sql"} 1.0' \
        in scrape.render().decode()
    llm.engine.step()
    assert 'running_lora_adapters="chat",waiting_lora_adapters="sql"' in scrape.render().decode()
    llm.engine.run(queued)
    llm.engine.load_lora("third", adapters["chat"])  # loaded beside the two, in no slot
    with pytest.raises(ValueError, match=r"all max_cpu_loras=3 adapters are loaded \(sql, chat, third\): unload one"):
        llm.engine.load_lora("fourth", adapters["sql"])
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    first = llm.generate([prompt], GREEDY, lora_request="sql")[0]
    assert llm.generate([prompt], GREEDY, lora_request="chat")[0].outputs[0].token_ids != first.outputs[0].token_ids
    import infer.model.lora as lora_module

    fusions = []
    fuse = lora_module._fused
    monkeypatch.setattr(lora_module, "_fused", lambda *a: fusions.append(a) or fuse(*a))
    back = llm.generate([prompt], GREEDY, lora_request="sql")[0]  # into the slot chat held
    assert fusions == []  # fused once, at its load: a swap copies only
    assert back.num_cached_tokens > 0 and back.outputs[0].token_ids == first.outputs[0].token_ids
    assert not llm.engine.has_unfinished


def test_a_request_behind_a_stream_of_another_adapters_requests_gets_a_slot(gqa_dir, adapters, monkeypatch):
    """One slot, two requests running at most: sql's requests keep arriving, chat's one waits behind the first. Passed
    over, it lets the sql requests behind it take the slot, which then never empties; after LORA_PATIENCE admissions
    they stop taking it, the running ones finish, and chat runs. With unbounded patience it never does."""
    from infer.engine import scheduler

    def steps_until_chat_finishes(patience: int) -> int | None:
        monkeypatch.setattr(scheduler, "LORA_PATIENCE", patience)
        eng = LLM(gqa_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
                  max_batch_size=2, lora_modules={k: str(adapters[k]) for k in ("sql", "chat")}).engine
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        eng.add_request([5, 6, 7], params, lora="sql")
        eng.step()
        chat = eng.add_request([5, 6, 7], params, lora="chat")
        for n in range(200):
            if sum(r.lora_name == "sql" and not r.finished for r in eng.requests.values()) < 3:
                eng.add_request([5, 6, 8], params, lora="sql")  # one more always waiting behind chat
            eng.step()
            if chat.finished:
                return n
        return None

    patience = scheduler.LORA_PATIENCE
    assert steps_until_chat_finishes(1 << 30) is None
    n = steps_until_chat_finishes(patience)
    assert n is not None and n < 3 * patience


def test_a_compiled_engine_reads_an_adapter_loaded_after_its_warm_up(gqa_dir, adapters):
    """The slots' buffers are the graphs' own (install_free_tensors): an adapter written into them after the graphs
    were built is what the next compiled step computes with, no recompile, the eager engine's tokens; unloaded, the
    row is the base model's again. Lone rows (test_lora_modules' compiled test builds mixed batches' graphs); writing
    into copies of the buffers instead fails here."""
    import torch

    picks = ["sql", None, "chat"]
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_batch_size=1, block_size=4)  # lone rows
    eager = LLM(gqa_dir, **kw)
    want = _tokens(eager.generate(PROMPTS, GREEDY, lora_request=[_req(adapters, x) for x in picks]))
    base = _tokens(eager.generate(PROMPTS[:1], GREEDY))
    llm = LLM(gqa_dir, compile=True, **kw)
    assert llm.engine.wait_until_ready(timeout=600)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=[_req(adapters, x) for x in picks])) == want
        llm.engine.unload_lora("sql")
        llm.engine.load_lora("sql2", adapters["sql"])
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request="sql2")) == want[:1]
        llm.engine.unload_lora("sql2")
        llm.engine.load_lora("sql", adapters["chat"])  # sql's old slot, chat's weights: not sql's tokens
        assert _tokens(llm.generate(PROMPTS[2:], GREEDY, lora_request="sql")) == want[2:]
        assert _tokens(llm.generate(PROMPTS[:1], GREEDY)) == base


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]


def test_the_server_loads_and_unloads_adapters_while_it_runs(gqa_dir, adapters):
    """`infer serve --enable-lora --max-loras 2`: /v1/load_lora_adapter makes an adapter a model id (listed by
    /v1/models, answering as the library does with it), /v1/unload_lora_adapter takes it away (then a 404); the
    refusals are 400s naming the problem; a server started without --enable-lora says how to get it."""
    from infer.server.__main__ import add_serve_args, describe, engine_config
    import argparse

    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = engine_config(p.parse_args(["--model", str(gqa_dir), "--dtype", "float32", "--enable-lora",
                                      "--max-loras", "2", "--max-lora-rank", "8"]))
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank) == (True, 2, 8)
    assert "2 LoRA slot(s) of rank 8 (/v1/load_lora_adapter)" in describe(cfg) and cfg.max_cpu_loras == 2
    more = engine_config(p.parse_args(["--model", str(gqa_dir), "--enable-lora", "--max-cpu-loras", "5"]))
    assert more.max_cpu_loras == 5 and "1 LoRA slot(s) of rank 16, 5 adapters loaded at most" in describe(more)
    llm = LLM(gqa_dir, dtype="float32", lora_modules={k: str(adapters[k]) for k in ("sql", "chat")})
    engine = AsyncEngine(cfg)
    try:
        with ServerThread(build_app(engine, "tiny")) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
            load, unload = srv.url + "/v1/load_lora_adapter", srv.url + "/v1/unload_lora_adapter"
            assert _post(load, {"lora_name": "sql", "lora_path": str(adapters["sql"])}) == (
                200, "Success: LoRA adapter 'sql' added successfully.")
            assert [m.id for m in client.models.list().data] == ["tiny", "sql"]
            assert client.models.retrieve("sql").model_extra["root"] == str(adapters["sql"])
            for name in ("sql", "tiny"):
                want = llm.generate(PROMPTS[:1], GREEDY, lora_request=None if name == "tiny" else name)
                got = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert got.choices[0].text == want[0].outputs[0].text
            code, why = _post(load, {"lora_name": "sql", "lora_path": str(adapters["chat"])})
            assert code == 400 and "loaded already" in why and "load_inplace" in why
            assert _post(load, {"lora_name": "sql", "lora_path": str(adapters["chat"]), "load_inplace": True})[0] == 200
            want = llm.generate(PROMPTS[:1], GREEDY, lora_request="chat")[0].outputs[0].text
            got = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == want
            code, why = _post(load, {"lora_name": "big", "lora_path": str(adapters["big"])})
            assert code == 400 and "above this engine's max_lora_rank 8" in why
            assert _post(load, {"lora_name": "tiny", "lora_path": str(adapters["sql"])})[0] == 400
            assert _post(load, {"lora_name": "x", "lora_path": "/nonexistent"})[0] == 400
            assert _post(load, {"lora_name": "x"})[0] == 400  # no path: the body's validation
            assert _post(unload, {"lora_name": "sql"}) == (200, "Success: LoRA adapter 'sql' removed successfully.")
            code, why = _post(unload, {"lora_name": "sql"})
            assert code == 404 and "no LoRA adapter named 'sql' is loaded" in why
            with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
                client.completions.create(model="sql", prompt="x", max_tokens=1)
            with urllib.request.urlopen(srv.url + "/openapi.json") as r:
                props = json.load(r)["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
            assert "enum" not in props  # the ids come and go
    finally:
        engine.shutdown()
    engine = AsyncEngine(EngineConfig(model=str(gqa_dir), dtype="float32"))
    try:
        with ServerThread(build_app(engine, "tiny")) as srv:
            code, why = _post(srv.url + "/v1/load_lora_adapter", {"lora_name": "sql",
                                                                   "lora_path": str(adapters["sql"])})
            assert code == 400 and "--enable-lora" in why
    finally:
        engine.shutdown()
