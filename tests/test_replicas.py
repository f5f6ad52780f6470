"""`infer serve --replicas 2`: two engine replicas behind Ray Serve's HTTP proxy on a local Ray instance (loopback).
32 concurrent clients (the official openai client and raw SSE streams) all complete with no 5xx, and both replicas
served traffic (every response names its replica). Skipped only where Ray Serve is not installed (it is an optional
dependency, part of the test extra)."""

import concurrent.futures as cf
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from infer.testing import make_tiny_llama, server_log, start_server, stop_server

pytest.importorskip("ray.serve", reason="Ray Serve is optional: pip install -e '.[ray]'")
openai = pytest.importorskip("openai")

NAME = "tiny"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    ckpt = make_tiny_llama(tmp_path_factory.mktemp("replicas"), "gqa", max_position_embeddings=1024)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server("--model", str(ckpt), "--served-model-name", NAME, "--port", str(port), "--replicas", "2",
                        "--replica-cpus", "0.5", "--max-batch-size", "4")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, up = time.monotonic() + 180, set()
        while len(up) < 2:  # both replicas answer /health
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    up.add(r.headers["x-infer-replica"])
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
            assert proc.poll() is None and time.monotonic() < deadline, server_log(proc)
        yield base, proc
    finally:
        stop_server(proc, grace=60)  # SIGTERM first: Ray Serve shuts its replicas down


def _stream(base: str, i: int) -> tuple[int, str, str]:
    body = {"model": NAME, "prompt": f"def f{i}(x):", "max_tokens": 48, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[6:].strip() for line in r if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        return r.status, r.headers["x-infer-replica"], json.loads(events[-2])["choices"][0]["finish_reason"]


def _chat(base: str, i: int) -> tuple[int, str, str]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=48, seed=i)
    reply = raw.parse()
    return raw.status_code, raw.headers["x-infer-replica"], reply.choices[0].finish_reason


def test_two_replicas_serve_32_concurrent_clients(replicas):
    base, proc = replicas
    with cf.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(_stream if i % 2 else _chat, base, i) for i in range(32)]
        results = [f.result() for f in futures]  # an HTTP error (any 4xx/5xx) raises here
    assert all(status == 200 for status, _, _ in results)
    assert all(end in ("length", "stop") for _, _, end in results)
    served = {replica for _, replica, _ in results}
    assert len(served) == 2, served  # both replicas took part
    assert proc.poll() is None


def test_the_replicas_share_one_openai_surface(replicas):
    base, _ = replicas
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.load(r)["data"]] == [NAME]
    body = {"model": NAME, "prompt": "x", "max_tokens": 5000}  # beyond the context: the replica's own 400
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "max_tokens" in json.load(e.value)["error"]["message"]


def test_replica_options_scale_on_requests_in_flight():
    from infer.engine import EngineConfig
    from infer.server.replicas import deployment

    cfg = EngineConfig(model="m", max_batch_size=6, max_waiting_requests=40)
    fixed = deployment(cfg, NAME, None, 1 << 20, replicas=2)._bound_deployment
    assert fixed.num_replicas == 2 and fixed.max_ongoing_requests == 12 and fixed.max_queued_requests == 40
    auto = deployment(cfg, NAME, None, 1 << 20, replicas=1, max_replicas=4)._bound_deployment
    scaling = auto._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 4, 6)


@pytest.mark.parametrize("flags, message", [(["--replicas", "0"], "--replicas must be an integer >= 1"),
                                            (["--replicas", "2", "--max-replicas", "1"], "--max-replicas (1) must be >= "),
                                            (["--replicas", "1", "--replica-cpus", "0"], "--replica-cpus must be > 0"),
                                            (["--replicas", "2", "--enable-lora"], "--enable-lora with --replicas")])
def test_bad_replica_flags_are_named(flags, message, capsys, tmp_path):
    from infer.server.__main__ import main

    assert main(["--model", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
