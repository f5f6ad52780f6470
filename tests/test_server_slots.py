"""GET /slots (llama-server's): one entry per KV slot, the request decoding there with its sampling parameters under
llama.cpp's names and its token counts; ``?fail_on_no_slot=1`` answers 503 only while every slot is taken; a server
started with ``--no-slots`` answers 501. The engine is stepped by hand, so what runs is known at each read."""

import argparse
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from infer import SamplingParams
from infer.engine import Engine, EngineConfig
from infer.server import slots
from infer.server.__main__ import add_serve_args
from infer.server.errors import install_error_handlers


@pytest.fixture(scope="module")
def engine(ckpt_dirs):
    return Engine(EngineConfig(model=ckpt_dirs["gqa"], draft_model=ckpt_dirs["mha"], spec_length=3,
                               max_batch_size=2, block_size=4))


def client(engine, on=True) -> TestClient:
    app = FastAPI()
    app.state.server = SimpleNamespace(engine=SimpleNamespace(engine=engine), slots=on, speculative=True,
                                       max_seq_len=engine.max_seq_len)
    install_error_handlers(app)
    app.include_router(slots.router)
    return TestClient(app)


def test_each_slot_shows_its_request_and_fail_on_no_slot_answers_503_only_while_all_are_taken(engine):
    http = client(engine)
    idle = http.get("/slots", params={"fail_on_no_slot": 1})
    assert idle.status_code == 200
    assert [(s["id"], s["is_processing"], s["id_task"], s["n_ctx"]) for s in idle.json()] == \
        [(0, False, -1, engine.max_seq_len), (1, False, -1, engine.max_seq_len)]
    assert idle.json()[0]["params"]["temperature"] == 0.8  # llama-server's defaults where nothing runs (/props')
    sampled = engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.5, top_k=7, seed=3, max_tokens=9,
                                                              stop=["zz"], ignore_eos=True), request_id="a")
    plain = engine.add_request([9, 10], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                               request_id="b", speculate=False)
    engine.step()
    engine.step()
    got = {s["request_id"]: s for s in http.get("/slots").json()}
    assert set(got) == {"a", "b"} and {got["a"]["id"], got["b"]["id"]} == {sampled.slot, plain.slot} == {0, 1}
    a, b = got["a"], got["b"]
    assert a["is_processing"] and a["id_task"] == sampled.seq and a["n_prompt_tokens"] == 4
    assert {k: a["params"][k] for k in ("temperature", "top_k", "seed", "n_predict", "stop", "ignore_eos")} == \
        {"temperature": 0.5, "top_k": 7, "seed": 3, "n_predict": 9, "stop": ["zz"], "ignore_eos": True}
    assert b["params"]["seed"] == slots.UNSET_SEED and b["params"]["temperature"] == 0
    assert a["params"]["speculative.n_max"] == 3 and a["speculative"] and not b["speculative"]  # b decodes plainly
    for s, r in ((a, sampled), (b, plain)):
        n = len(r.output_ids)
        assert n > 0 and s["next_token"] == {"has_next_token": True, "has_new_line": "\n" in r.text,
                                             "n_remain": r.params.max_tokens - n, "n_decoded": n}
    full = http.get("/slots", params={"fail_on_no_slot": 1})
    assert full.status_code == 503 and full.json()["error"]["message"] == "no slot available"
    assert http.get("/slots", params={"fail_on_no_slot": 0}).status_code == 200  # 0 asks for no failure
    freed = sampled.slot
    while not sampled.finished:
        engine.step()
    after = http.get("/slots", params={"fail_on_no_slot": 1})  # a's slot is free again, b's is not
    assert after.status_code == 200
    assert [s["request_id"] for s in after.json()] == [None if i == freed else "b" for i in range(2)]
    engine.run([plain])


def test_no_slots_answers_501_by_name():
    r = client(SimpleNamespace(max_seq_len=64), on=False).get("/slots")
    assert r.status_code == 501 and "--no-slots" in r.json()["error"]["message"]
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args(["--model", "m"]).slots and not p.parse_args(["--model", "m", "--no-slots"]).slots
