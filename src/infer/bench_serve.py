"""``infer bench-serve``: a bounded streaming load generator against a running server (official openai client).

N clients each send M streaming completions one after another; reported: requests ok / failed (with status
codes), output tokens/s over the whole run, time to first token and request latency percentiles, and the
acceptance rate from the final usage chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--clients", type=int, default=8, help="N concurrent clients")
    p.add_argument("--requests-per-client", type=int, default=4, help="M requests each, sequentially")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: demo prompts)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", default=None, help="also write the summary here")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


async def _one(client, model, prompt, a) -> dict:
    t0 = time.perf_counter()
    ttft, n, usage = None, 0, None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=a.max_tokens,
                                             temperature=a.temperature, stream=True,
                                             stream_options={"include_usage": True}, timeout=a.timeout)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
            n = usage["completion_tokens"]
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "tokens": n, "usage": usage}


async def bench(a) -> dict:
    try:
        from openai import APIConnectionError, APIStatusError, AsyncOpenAI
    except ImportError as e:
        raise ValueError("bench-serve uses the official openai client: pip install openai") from e
    client = AsyncOpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0)
    try:  # the server first: one clear line when it is not there (or refuses the key), before any load is sent
        served = (await client.models.list()).data
    except APIConnectionError as e:
        raise ValueError(f"bench-serve: no server answers at {a.base_url} ({e}); start one with `infer serve`") from e
    except APIStatusError as e:
        raise ValueError(f"bench-serve: {a.base_url}/models answered {e.status_code}: {e.message}") from e
    if not a.model and not served:
        raise ValueError(f"bench-serve: the server at {a.base_url} serves no model")
    model = a.model or served[0].id
    prompts = a.prompt
    if not prompts:
        from .demo import demo_prompts

        prompts = [p["prompt"] for p in demo_prompts()]
    results, errors, why = [], {}, {}  # why: each kind of failure's first message (a count alone says little)

    async def worker(i: int):
        for j in range(a.requests_per_client):
            try:
                results.append(await _one(client, model, prompts[(i * a.requests_per_client + j) % len(prompts)], a))
            except Exception as e:  # noqa: BLE001 - counted, the load goes on
                kind = e.status_code if isinstance(e, APIStatusError) else type(e).__name__
                errors[kind] = errors.get(kind, 0) + 1
                why.setdefault(kind, getattr(e, "message", None) or str(e))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(a.clients)])
    wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    drafted = sum((r["usage"] or {}).get("num_draft_tokens") or 0 for r in results)
    accepted = sum((r["usage"] or {}).get("num_accepted_tokens") or 0 for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    lat = [r["latency"] for r in results]
    return {"clients": a.clients, "requests_per_client": a.requests_per_client, "max_tokens": a.max_tokens,
            "ok": len(results), "failed": errors, "failures": why, "wall_s": wall,
            "output_tok_s": toks / wall if wall else 0.0, "output_tokens": toks,
            "acceptance_rate": accepted / drafted if drafted else None,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "latency_p50": _pct(lat, 50),
            "latency_p99": _pct(lat, 99), "latency_mean": statistics.fmean(lat) if lat else None}


def run_bench(a) -> dict:
    if a.clients < 1 or a.requests_per_client < 1:
        raise ValueError("--clients and --requests-per-client must be >= 1")
    r = asyncio.run(bench(a))
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"{r['ok']} ok, failed {r['failed'] or 0}; {r['output_tokens']} tokens in {r['wall_s']:.1f}s = "
          f"{r['output_tok_s']:.1f} tok/s; TTFT p50 {fmt(r['ttft_p50'])}s p99 {fmt(r['ttft_p99'])}s; latency p50 "
          f"{fmt(r['latency_p50'])}s p99 {fmt(r['latency_p99'])}s; acceptance {fmt(r['acceptance_rate'])}")
    for kind, message in r["failures"].items():  # what each kind of failure said, once
        print(f"  failed with {kind} ({r['failed'][kind]}x), the first: {message}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return r
