"""Bounded load test of the HTTP server on the shipped demo pair, speculation on.

Starts ``python -m infer.server`` (a separate process, so the load generator does not share its GIL), then runs
``infer bench-serve``'s generator: N streaming clients x M requests each (official openai client). Checks that every
request completes, that no 5xx came back, and (via /metrics) that the KV pool is fully free afterwards. Writes
JSON and a table in docs/benchmarks.md.

    python benchmarks/serve_load.py [--clients 32] [--requests-per-client 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, machine, update_doc_section, write_json  # noqa: E402

from infer.bench_serve import bench  # noqa: E402
from infer.demo import demo_model_paths  # noqa: E402


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, val = line.rsplit(" ", 1)
            out[name] = float(val)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec-length", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    target, drafter = demo_model_paths()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "infer.server", "--model", str(target), "--draft-model", str(drafter),
           "--spec-length", str(a.spec_length), "--max-batch-size", str(a.max_batch_size), "--dtype", a.dtype,
           "--port", str(port), "--served-model-name", "demo", "--max-seq-len", "1024"]
    proc = subprocess.Popen(cmd)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        ns = argparse.Namespace(base_url=url + "/v1", model="demo", api_key="none", clients=a.clients,
                                requests_per_client=a.requests_per_client, max_tokens=a.max_tokens, temperature=0.0,
                                prompt=None, timeout=600.0)
        r = asyncio.run(bench(ns))
        time.sleep(0.5)
        m = scrape(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    fivexx = sum(v for k, v in r["failed"].items() if isinstance(k, int) and k >= 500)
    r.update({"machine": machine(), "dtype": a.dtype, "K": a.spec_length, "max_batch_size": a.max_batch_size,
              "kv_usage_after": m.get("infer_kv_cache_usage"), "running_after": m.get("infer_requests_running"),
              "server_acceptance": (m["infer_spec_accepted_tokens_total"] / m["infer_spec_draft_tokens_total"]
                                    if m.get("infer_spec_draft_tokens_total") else None),
              "all_completed": r["ok"] == a.clients * a.requests_per_client, "num_5xx": fivexx})
    write_json("serve_load", r)
    mm = r["machine"]
    update_doc_section("serve_load", "\n".join([
        f"Machine: {mm['cpu']}, torch {mm['torch']}; server process `python -m infer.server` on the demo pair, "
        f"{a.dtype}, speculative K={a.spec_length}, max_batch_size {a.max_batch_size}, paged KV; load: "
        f"{a.clients} concurrent streaming clients x {a.requests_per_client} requests (official openai client, "
        f"held-out code prompts, {a.max_tokens} tokens, greedy).", "",
        "| requests ok | failed | 5xx | output tok/s | TTFT p50 | TTFT p99 | latency p50 | latency p99 | acceptance "
        "| KV in use after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['ok']}/{a.clients * a.requests_per_client} | {sum(r['failed'].values())} | {fivexx} | "
        f"{r['output_tok_s']:.1f} | {r['ttft_p50']:.2f} s | {r['ttft_p99']:.2f} s | {r['latency_p50']:.2f} s | "
        f"{r['latency_p99']:.2f} s | {r['acceptance_rate']:.2f} | {r['kv_usage_after']:.3f} |"]))
    print(r)


if __name__ == "__main__":
    main()
