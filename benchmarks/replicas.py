"""Replicas behind Ray Serve against one server, and autoscaling on load (issue 19).

    python benchmarks/replicas.py [--clients 32] [--seconds 30] [--rounds 2] [--autoscale-seconds 100]

The shipped demo pair, speculating (draft model, auto K), max_batch_size 16, non-streaming completions of 64 tokens
over the demo prompts; a thread per client, each sending its next request when the last returns.

1. Throughput, interleaved (A B A B, each a window of --seconds under --clients clients; both servers up throughout,
   the idle one waiting): `infer serve` (one engine, 2 threads) vs `infer serve --replicas 2` (two engines on Ray
   Serve, one CPU each). Tokens/s = completion tokens finished in the window / window; per side the median.
2. Autoscaling: `infer serve --replicas 1 --max-replicas 2` under the same load for --autoscale-seconds: when the second
   replica first serves a request, and tokens/s per 5 s window by replica (Ray Serve's default upscale delay: 30 s).
Writes benchmarks/results/replicas.json, the "replicas" section of docs/benchmarks.md and docs/replicas.png.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, machine, update_doc_section, write_json  # noqa: E402

from infer.demo import demo_model_paths, demo_prompts  # noqa: E402


def start(extra: list[str]) -> tuple[subprocess.Popen, str]:
    target, drafter = demo_model_paths()
    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", str(target), "--draft-model", str(drafter),
           "--served-model-name", "demo", "--max-batch-size", "16", "--max-seq-len", "1024", "--port", str(port),
           *extra]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


def wait_up(proc, url: str, replicas: int) -> None:
    seen, deadline = set(), time.monotonic() + 300
    while len(seen) < replicas:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                seen.add(r.headers.get("x-infer-replica"))
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server at {url} did not come up")


def load(url: str, clients: int, seconds: float, prompts: list[str]) -> list[tuple[float, int, str | None, int]]:
    """(finish time, completion tokens, replica, status) of every request that finished inside the window."""
    t0, out, lock = time.monotonic(), [], threading.Lock()

    def client(i: int):
        j = 0
        while time.monotonic() - t0 < seconds:
            body = {"model": "demo", "prompt": prompts[(i + j) % len(prompts)], "max_tokens": 64, "ignore_eos": True}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    n, rep, status = json.load(r)["usage"]["completion_tokens"], r.headers.get("x-infer-replica"), 200
            except urllib.error.HTTPError as e:
                n, rep, status = 0, None, e.code
            t = time.monotonic() - t0
            if t <= seconds:
                with lock:
                    out.append((t, n, rep, status))
            j += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--autoscale-seconds", type=float, default=100)
    a = ap.parse_args()
    prompts = [p["prompt"] for p in demo_prompts()]

    # 1. one engine vs two replicas, interleaved
    sides = {"single": start([]), "replicas": start(["--replicas", "2", "--replica-cpus", "1"])}
    try:
        wait_up(*sides["single"], 1)
        wait_up(*sides["replicas"], 2)
        for name, (_, url) in sides.items():  # warm-up: first requests, the draft/verify paths
            load(url, 4, 5, prompts)
        windows = {name: [] for name in sides}
        for _ in range(a.rounds):
            for name, (_, url) in sides.items():
                res = load(url, a.clients, a.seconds, prompts)
                windows[name].append({"tokens_per_s": sum(n for _, n, _, _ in res) / a.seconds,
                                      "requests": len(res), "non_200": sum(s != 200 for *_, s in res),
                                      "by_replica": {r: sum(1 for *_, rr, _ in res if rr == r)
                                                     for r in {rr for *_, rr, _ in res}}})
                print(name, windows[name][-1], flush=True)
    finally:
        for proc, _ in sides.values():
            stop(proc)

    # 2. autoscaling from 1 to 2 replicas under the same load
    proc, url = start(["--replicas", "1", "--max-replicas", "2", "--replica-cpus", "1"])
    try:
        wait_up(proc, url, 1)
        trace = load(url, a.clients, a.autoscale_seconds, prompts)
    finally:
        stop(proc)
    first = {}
    for t, _, rep, _ in sorted(trace):
        first.setdefault(rep, t)
    step = 5
    bins = {}
    for t, n, rep, _ in trace:
        bins.setdefault(rep, [0] * int(a.autoscale_seconds // step + 1))[int(t // step)] += n / step

    med = {k: statistics.median(w["tokens_per_s"] for w in v) for k, v in windows.items()}
    data = {"machine": machine(), "models": "demo pair (23M target, 1.4M drafter), float32, speculative (auto K)",
            "clients": a.clients, "window_s": a.seconds, "rounds": a.rounds, "max_tokens": 64,
            "throughput": windows, "median_tokens_per_s": med,
            "autoscale": {"seconds": a.autoscale_seconds, "first_response_s_by_replica": first,
                          "tokens_per_s_per_5s_by_replica": bins,
                          "non_200": sum(s != 200 for *_, s in trace), "requests": len(trace)}}
    write_json("replicas", data)
    later = sorted(first.values())
    lines = ["## Replicas behind Ray Serve (issue 19)", "",
             f"`benchmarks/replicas.py`: {data['machine']['cpu']}, {data['machine']['cores']} vCPU. {data['models']}, "
             f"max_batch_size 16, {a.clients} clients sending non-streaming 64-token completions back to back; "
             f"{a.rounds} interleaved windows of {a.seconds:.0f} s per side, median.", "",
             "| side | tokens/s (median) | windows | requests | non-200 |", "|---|---|---|---|---|"]
    for name, label in (("single", "`infer serve` (1 engine, 2 threads)"),
                        ("replicas", "`infer serve --replicas 2` (Ray Serve, 1 CPU each)")):
        w = windows[name]
        per_window = ", ".join(f"{x['tokens_per_s']:.0f}" for x in w)
        lines.append(f"| {label} | {med[name]:.0f} | {per_window} | "
                     f"{sum(x['requests'] for x in w)} | {sum(x['non_200'] for x in w)} |")
    lines += ["", f"Autoscaling (`--replicas 1 --max-replicas 2`, the same load for {a.autoscale_seconds:.0f} s): "
                  f"{len(first)} replica(s) served; "
              + (f"the second first answered at {later[1]:.0f} s. " if len(later) > 1 else "no second replica came up. ")
              + f"{data['autoscale']['requests']} requests, {data['autoscale']['non_200']} not 200. "
                "Ray Serve's default upscale delay is 30 s; a new replica then loads its model.",
              "", "![autoscaling](replicas.png)"]
    update_doc_section("replicas", "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    xs = [i * step for i in range(int(a.autoscale_seconds // step + 1))]
    bottom = [0.0] * len(xs)
    for k, (rep, ys) in enumerate(sorted(bins.items(), key=lambda kv: first[kv[0]])):
        ax.bar(xs, ys, width=step * 0.9, bottom=bottom, align="edge", label=f"replica {k + 1} ({rep})")
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xlabel("seconds under load")
    ax.set_ylabel("tokens/s (5 s windows)")
    ax.set_title(f"--replicas 1 --max-replicas 2, {a.clients} clients", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "replicas.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
