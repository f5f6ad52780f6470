"""Soak test of ``infer serve``: many clients, random requests, early closes, for minutes; failures, latency, memory.

    python benchmarks/soak.py [--clients 16] [--duration 600] [--early-close 0.05] [--demo]

Starts ``python -m infer.server`` in its own process (default: SmolLM2-135M-Instruct, int8, bfloat16, speculating
with the hybrid of prompt lookup and the shipped EAGLE head; ``--demo``: the shipped demo pair), then ``--clients``
threads send requests back to back for ``--duration`` seconds. Each request draws its route (completion or chat),
streaming or not, temperature 0 .. 1.2, top-p, top-k, max_tokens 8 .. 128 and a seed; a fraction ``--early-close``
of them hang up early (a stream after its first chunks, a plain request after 0.3 s). A failure is a 5xx, a refused
connection or a malformed answer; intentional early closes are counted apart. The server's RSS (/proc) is sampled
every 5 s; at the end /metrics must show the KV pool empty. Writes benchmarks/results/soak.json, the "soak" section
of docs/benchmarks.md and soak.png (RSS over time).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, free_port, machine, update_doc_section, write_json  # noqa: E402

PROMPTS = ["Explain why the sky is blue.", "Write a Python function that reverses a list.", "def fibonacci(n):",
           "List three uses of a hash map.", "import os\nfor root, dirs, files in os.walk('.'):",
           "Summarise the plot of a detective story in two sentences."]


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_cmd(a, port: int) -> tuple[list[str], str]:
    base = [sys.executable, "-m", "infer.server", "--port", str(port), "--max-batch-size", "8"]
    if a.demo:
        from infer.demo import demo_model_paths

        target, drafter = demo_model_paths()
        return base + ["--model", str(target), "--draft-model", str(drafter)], "demo pair (23M + 1.4M drafter)"
    from infer.demo import REAL_MODEL_SETTINGS, drafter_paths, real_model_path

    return base + ["--model", str(real_model_path()), "--draft-model", str(drafter_paths()["eagle"]),
                   "--proposer", "hybrid", "--dtype", REAL_MODEL_SETTINGS["dtype"], "--quantization",
                   REAL_MODEL_SETTINGS["quantization"]], "SmolLM2-135M-Instruct int8 bf16, hybrid n-gram + EAGLE"


class Client(threading.Thread):
    def __init__(self, url: str, model: str, stop_at: float, early: float, seed: int):
        super().__init__(daemon=True)
        self.url, self.model, self.stop_at, self.early = url, model, stop_at, early
        self.rnd = random.Random(seed)
        self.latency: list[float] = []
        self.ok = self.closed = 0
        self.failures: list[str] = []

    def body(self) -> tuple[str, dict]:
        r, chat = self.rnd, self.rnd.random() < 0.5
        body = {"model": self.model, "max_tokens": r.randint(8, 128), "temperature": round(r.uniform(0, 1.2), 2),
                "top_p": round(r.uniform(0.5, 1.0), 2), "top_k": r.choice([-1, 5, 40]), "seed": r.randrange(2**32),
                "stream": r.random() < 0.5}
        prompt = r.choice(PROMPTS)
        if chat:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}

    def run(self) -> None:
        while time.monotonic() < self.stop_at:
            path, body = self.body()
            close_early = self.rnd.random() < self.early
            req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=0.3 if close_early and not body["stream"] else 300) as resp:
                    if body["stream"]:
                        events, last = 0, b""
                        for line in resp:
                            if line.startswith(b"data: "):  # events are "data: ...\n" then a blank line
                                events, last = events + 1, line.strip()
                                if close_early and events >= 3:
                                    break
                        if close_early:
                            self.closed += 1
                            continue
                        if last != b"data: [DONE]":
                            self.failures.append("stream without [DONE]")
                            continue
                    else:
                        if not json.loads(resp.read())["choices"]:
                            self.failures.append("no choices")
                            continue
                self.ok += 1
                self.latency.append(time.monotonic() - t0)
            except urllib.error.HTTPError as e:
                self.failures.append(f"HTTP {e.code}: {e.read()[:200]!r}")
            except (TimeoutError, socket.timeout, urllib.error.URLError) as e:
                if close_early:
                    self.closed += 1
                else:
                    self.failures.append(f"{type(e).__name__}: {e}")


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--early-close", type=float, default=0.05)
    ap.add_argument("--demo", action="store_true", help="the demo pair instead of SmolLM2")
    a = ap.parse_args()
    port = free_port()
    cmd, what = server_cmd(a, port)
    model = cmd[cmd.index("--model") + 1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: {proc.stderr.read()}")
                time.sleep(1)
        # one request first: the speculating engine's first rounds compile the rest of its graphs
        urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": model, "prompt": "hello", "max_tokens": 32}).encode(),
            headers={"content-type": "application/json"}), timeout=900).read()
        t_start = time.monotonic()
        rss = [(0.0, rss_mb(proc.pid))]
        clients = [Client(url, model, t_start + a.duration, a.early_close, seed=i) for i in range(a.clients)]
        for c in clients:
            c.start()
        while any(c.is_alive() for c in clients):
            time.sleep(5)
            rss.append((time.monotonic() - t_start, rss_mb(proc.pid)))
        time.sleep(1)
        metrics = scrape(url)
        lat = sorted(x for c in clients for x in c.latency)
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
        steady = [m for t, m in rss if t >= min(60.0, a.duration / 4)] or [rss[-1][1]]
        res = {"machine": machine(), "server": what, "clients": a.clients, "duration_s": a.duration,
               "early_close": a.early_close, "requests_ok": sum(c.ok for c in clients),
               "closed_early": sum(c.closed for c in clients),
               "failures": sum(len(c.failures) for c in clients),
               "failure_examples": sorted({f for c in clients for f in c.failures})[:10],
               "latency_s": {"p50": q[49], "p90": q[89], "p99": q[98], "max": lat[-1] if lat else None},
               "rss_mb": rss, "rss_growth_after_warmup": steady[-1] / steady[0] - 1,
               "kv_cache_usage_after": metrics.get("infer_kv_cache_usage"),
               "requests_by_status": {k.split('"')[1]: v for k, v in metrics.items()
                                      if k.startswith("infer_requests_total{")}}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    write_json("soak", res)
    update_doc_section("soak", render(res))
    plot(res)
    print(render(res))


def render(res: dict) -> str:
    lat, m = res["latency_s"], res["machine"]
    return "\n".join([
        "## Soak: many clients against `infer serve` (issue 18)", "",
        f"`python benchmarks/soak.py` ({m['cpu']}, {m['cores']} cores, {m['date']}): {res['server']}; "
        f"{res['clients']} clients for {res['duration_s']:.0f} s, random routes / streaming / sampling, "
        f"{res['early_close']:.0%} of requests closed early by the client.", "",
        "| requests ok | closed early | failures | p50 / p90 / p99 latency | RSS growth after warm-up | "
        "KV in use after |", "|---|---|---|---|---|---|",
        f"| {res['requests_ok']} | {res['closed_early']} | {res['failures']} | {lat['p50']:.2f} / {lat['p90']:.2f} / "
        f"{lat['p99']:.2f} s | {res['rss_growth_after_warmup']:+.1%} | {res['kv_cache_usage_after']} |", "",
        f"Requests by final status (server's count): {res['requests_by_status']}.", "",
        "![soak](../benchmarks/results/soak.png)"])


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, mb = zip(*res["rss_mb"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, mb, marker=".")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title(f"infer serve, {res['clients']} clients: RSS over time")
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=110)


if __name__ == "__main__":
    main()
