"""A lone request through the server's loop thread against the library's own call: the OpenMP pools.

    python benchmarks/serve_thread.py [--prompts 24] [--max-tokens 128] [--render]

SmolLM2 as `infer chat` runs it (its defaults, one KV slot: no warm-up), one request at a time, greedy, each held-out
prompt (chat and code alternating) once per variant, the variants' order rotating by prompt:
  library         ``LLM.stream`` in the thread that built the engine
  async, pool kept     a second such engine stepped by ``AsyncEngine``'s loop thread while the building thread's OpenMP
                  workers live (they do after any parallel region there: the library's run just before)
  async, released the same, the building thread's pool released first (``kernels.release_thread_pool``: what
                  AsyncEngine's constructor does since 2026-12-08)
  HTTP server     ``infer serve --model smollm2 --max-batch-size 1`` (a separate process, idle meanwhile), streamed
                  chat completions
The suffix tree is emptied before each in-process generation; the server's is not (each prompt is new to it). After
each loop-thread run the loop thread's pool is released too, so the library's runs have no second pool beside them.
Decode tok/s from the first output to the last (the server's: from its first chunk with a "content" key, the
role chunk's empty one included, one chunk more over a slightly longer span); per variant the median over prompts of its speed over the library's
on the same prompt. Writes benchmarks/results/serve_thread.json and the "serve-thread" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, machine, results_of, update_doc_section  # noqa: E402

VARIANTS = ["library", "async, pool kept", "async, released", "HTTP server"]


def _http(port: int, text: str, max_tokens: int) -> tuple[int, float]:
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content":' in line:
                stamps.append(time.perf_counter())
    return len(stamps), stamps[-1] - stamps[0]


def run(n_prompts: int, max_tokens: int) -> dict:
    import torch

    from infer import LLM, SamplingParams, kernels
    from infer.demo import CHAT_ENGINE
    from infer.drafters import eval_prompts
    from infer.engine.async_engine import AsyncEngine

    held = eval_prompts()
    texts = [t for pair in zip(held["chat"], held["code"]) for t in (pair[0]["prompt"], pair[1]["prompt"])][:n_prompts]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "infer.server", "--model", "smollm2", "--port", str(port),
                               "--max-batch-size", "1"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        llm = LLM("smollm2", **CHAT_ENGINE)
        # a second engine for the loop thread: an Engine is stepped by one thread only (the loop thread, idle after
        # a request, may step one again while another thread's request is in it)
        looped = LLM("smollm2", **CHAT_ENGINE)
        engine = AsyncEngine(looped.engine)
        tok, params = llm.tokenizer, SamplingParams(temperature=0, max_tokens=max_tokens)
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(0.5)

        def library(ids):
            stamps = [time.perf_counter() for _ in llm.stream(ids, params)]
            return len(stamps), stamps[-1] - stamps[0]

        async def stream(ids):
            stamps = []
            async for _ in engine.generate(ids, params):
                stamps.append(time.perf_counter())
            # and the loop thread's own pool released after it, in that thread, so that the library's next run in
            # this one has no second pool beside it either (it ran at half speed after the loop thread's runs)
            await engine._call(kernels.release_thread_pool)
            return len(stamps), stamps[-1] - stamps[0]

        def in_loop(ids, release):
            x = torch.ones(1 << 22)
            for _ in range(4):
                x.mul_(1.0)  # a parallel region in this thread: its pool exists, as after any torch work here
            if release:
                kernels.release_thread_pool()
            return asyncio.run(stream(ids))

        rows = []
        for i, text in enumerate(texts):
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            row = {"prompt": i}
            order = VARIANTS[i % 4:] + VARIANTS[:i % 4]
            for v in order:
                llm.engine.decoder.proposer.clear()
                looped.engine.decoder.proposer.clear()
                if v == "library":
                    n, s = library(ids)
                elif v == "HTTP server":
                    n, s = _http(port, text, max_tokens)
                else:
                    n, s = in_loop(ids, v == "async, released")
                row[v] = n / s
            rows.append(row)
            print(i, {k: round(v, 1) for k, v in row.items() if k != "prompt"}, flush=True)
        engine.shutdown()
    finally:
        server.terminate()
        server.wait(60)
    return {"machine": machine(), "max_tokens": max_tokens, "rows": rows}


def render(res: dict) -> str:
    m, rows = res["machine"], res["rows"]
    lines = [f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']} (revision {m['revision']}); SmolLM2 "
             f"as `infer chat` runs it, {len(rows)} held-out prompts once per variant (order rotating), greedy, "
             f"{res['max_tokens']} tokens at most; tok/s from the first token to the last (`LLM.stream` for the "
             "library).", "",
             "| variant | tok/s, median (quartiles) | over the library, per prompt: median (quartiles) |",
             "|---|---|---|"]
    for v in VARIANTS:
        xs = [r[v] for r in rows]
        q = statistics.quantiles(xs, n=4)
        rel = [r[v] / r["library"] for r in rows]
        qr = statistics.quantiles(rel, n=4)
        lines.append(f"| {v} | {statistics.median(xs):.0f} ({q[0]:.0f}-{q[2]:.0f}) | {statistics.median(rel):.2f}x "
                     f"({qr[0]:.2f}-{qr[2]:.2f}x) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    res = results_of("serve_thread", a.render, lambda: run(a.prompts, a.max_tokens))
    md = render(res)
    update_doc_section("serve-thread", md)
    print(md)


if __name__ == "__main__":
    main()
