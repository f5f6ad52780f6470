"""Speculation through the path users run (``LLM`` and the engine), defaults against hand-picked settings.

    python benchmarks/speculation.py [--repeats 5] [--new-tokens 96] [--only defaults,ngram,sampled,load]

Four parts, each timed A B A B ... in one process (per variant the median over repeats of the whole request set):
  defaults  shipped demo pair, held-out prompts plus fresh ones, greedy, one request at a time:
            ``LLM(target, draft_model=drafter)`` with no other argument, against plain decoding at the same dtype and
            against hand-picked K / draft-vocabulary settings
  ngram     SmolLM2-135M-Instruct (the real model; int8 weights, bfloat16, as the demo runs it) with prompt lookup
            (``LLM(model, proposer="ngram")``): a code-editing prompt whose answer copies the code, and a prompt
            whose answer copies nothing
  sampled   temperature 1, both proposers, against plain decoding
  load      the engine at concurrency 1, 2, 4, 8, 16, auto K, against the same engine without speculation: generated
            tokens per second of wall clock with c requests in flight (closed loop), and for one batch of c requests
Writes benchmarks/results/speculation.json and the "speculation" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, interleaved, machine, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import demo_model_paths, demo_prompts, real_model_path  # noqa: E402

# Prompts the project never trained or tuned on, written for this benchmark (besides the held-out stdlib modules).
FRESH = [
    "import json\nfrom pathlib import Path\n\n\ndef load_settings(path):\n    \"\"\"Read a JSON settings file, "
    "returning an empty dict if it does not exist.\"\"\"\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n",
    "def parse_header(line):\n    name, _, value = line.partition(':')\n",
]
CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result'''
EDIT_CHAT = [{"role": "user", "content": "Add a docstring and type hints to this Python function. Reply with the "
              f"full function only.\n\n```python\n{CODE}\n```"}]
NO_MATCH_CHAT = [{"role": "user", "content": "Write a short poem about autumn leaves."}]


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def compare(variants: dict, prompts, params, repeats: int, base: str, concurrent: bool = False) -> dict:
    """variants {name: LLM}; every prompt once per variant per round -> tok/s (median, quartiles), speedup vs base.
    One request at a time, unless ``concurrent``: then all prompts are queued together."""
    for llm in variants.values():  # warm-up: first calls, the cost model's first refreshes
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16))
    outputs, decode_s = {}, {n: [] for n in variants}

    def run(name):
        def go():
            llm = variants[name]
            outputs[name] = llm.generate(prompts, params) if concurrent else [llm.generate([p], params)[0]
                                                                              for p in prompts]
            # decode time: first token to last, per request (the prompt's prefill and TTFT excluded), summed
            decode_s[name].append(sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outputs[name]))
        return go

    times = interleaved({n: run(n) for n in variants}, repeats)
    tokens = {n: sum(len(o.token_ids) for o in outputs[n]) for n in variants}
    rows = {}
    for n, ts in times.items():
        q1, med, q3 = quartiles([(tokens[n] - len(prompts)) / t for t in decode_s[n]])
        o = outputs[n]
        drafted = sum(x.num_draft_tokens for x in o)
        rows[n] = {"tok_s": med, "q1": q1, "q3": q3, "tokens": tokens[n],
                   "whole_request_tok_s": statistics.median(tokens[n] / t for t in ts),
                   "acceptance": sum(x.num_accepted_tokens for x in o) / drafted if drafted else None,
                   "same_as_base": [x.token_ids for x in o] == [x.token_ids for x in outputs[base]]}
    for r in rows.values():
        r["speedup"] = r["tok_s"] / rows[base]["tok_s"]
    return rows


def part_defaults(a) -> dict:
    t, d = demo_model_paths()
    prompts = [p["prompt"] for p in demo_prompts()] + FRESH
    variants = {"plain (AR)": LLM(t), "defaults: LLM(target, draft_model)": LLM(t, draft_model=d)}
    for k in (3, 4, 6):
        variants[f"K={k}, draft vocab 2048"] = LLM(t, draft_model=d, spec_length=k)
    variants["K=6, full vocab"] = LLM(t, draft_model=d, spec_length=6, draft_vocab_size=None)
    variants["float32 plain (AR)"] = LLM(t, dtype="float32")
    variants["float32 defaults"] = LLM(t, dtype="float32", draft_model=d)
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens)
    rows = compare(variants, prompts, params, a.repeats, "plain (AR)")
    f32 = rows["float32 plain (AR)"]["tok_s"]
    for n in ("float32 plain (AR)", "float32 defaults"):
        rows[n]["speedup_vs_f32_ar"] = rows[n]["tok_s"] / f32
    return {"dtype": str(variants["plain (AR)"].dtype), "prompts": len(prompts), "rows": rows}


def part_ngram(a) -> dict:
    path = real_model_path()
    settings = {"dtype": "bfloat16", "quantization": "int8"}
    plain, ngram = LLM(path, **settings), LLM(path, proposer="ngram", **settings)
    out = {}
    for name, chat in (("code edit", EDIT_CHAT), ("no match (poem)", NO_MATCH_CHAT)):
        ids = plain.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        params = SamplingParams(temperature=0, max_tokens=a.ngram_tokens)
        out[name] = compare({"plain (AR)": plain, "ngram": ngram}, [ids], params, a.repeats, "plain (AR)")
    return {"model": "SmolLM2-135M-Instruct", **settings, "workloads": out}


def part_sampled(a) -> dict:
    t, d = demo_model_paths()
    prompts = [p["prompt"] for p in demo_prompts()][:4]
    variants = {"plain (AR)": LLM(t), "draft model (defaults)": LLM(t, draft_model=d),
                "ngram": LLM(t, proposer="ngram"), "hybrid": LLM(t, draft_model=d, proposer="hybrid")}
    params = SamplingParams(temperature=1.0, max_tokens=a.new_tokens, seed=0)
    return {"rows": compare(variants, prompts, params, a.repeats, "plain (AR)")}


def closed_loop(llm: LLM, prompts: list[str], clients: int, per_client: int, params: SamplingParams) -> float:
    """``clients`` requests in flight: each finished request is replaced by the next until clients x per_client have
    run (vLLM's ``--max-concurrency``) -> generated tokens per second of wall clock, prefill included."""
    eng, ids = llm.engine, [llm.tokenizer.encode(p) for p in prompts]
    total, sent, done, tokens, live = clients * per_client, 0, 0, 0, []
    t0 = time.perf_counter()
    while done < total:
        while len(live) < clients and sent < total:
            live.append(eng.add_request(ids[sent % len(ids)], params))
            sent += 1
        eng.step()
        for r in [r for r in live if r.finished]:
            live.remove(r)
            done, tokens = done + 1, tokens + len(r.output_ids)
    return tokens / (time.perf_counter() - t0)


def part_load(a) -> dict:
    """Concurrency c: the same engine with and without speculation, c requests in flight (steady state), and one
    batch of c requests admitted together (its ramp and its tail: rows that finish early leave smaller batches)."""
    t, d = demo_model_paths()
    prompts = [p["prompt"] for p in demo_prompts()] + FRESH
    params = SamplingParams(temperature=0, max_tokens=a.load_tokens, ignore_eos=True)
    out = {}
    for c in (1, 2, 4, 8, 16):
        variants = {"plain": LLM(t, max_batch_size=c), "spec auto": LLM(t, draft_model=d, max_batch_size=c)}
        for llm in variants.values():  # warm-up: first calls, the cost model's first refreshes
            closed_loop(llm, prompts, c, 1, params)
        rates = {n: [] for n in variants}
        for _ in range(a.repeats):  # A B A B ...
            for n, llm in variants.items():
                rates[n].append(closed_loop(llm, prompts, c, a.load_waves, params))
        rows = {}
        for n, xs in rates.items():
            q1, med, q3 = quartiles(xs)
            rows[n] = {"tok_s": med, "q1": q1, "q3": q3, "best_tok_s": max(xs)}
        once = compare(variants, (prompts * 4)[:c], params, a.repeats, "plain", concurrent=True)
        for n in rows:
            rows[n]["one_batch_tok_s"] = once[n]["whole_request_tok_s"]
            rows[n]["acceptance"] = once[n]["acceptance"]
        rows["spec auto"]["k_last"] = variants["spec auto"].engine.decoder.spec_length.last_choice
        out[c] = rows
    return out


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; {res['repeats']} interleaved repeats, "
             "medians [quartiles] of decode tokens per second (first token to last, summed over the prompt set; the "
             "prompt's prefill is excluded, `whole` includes it). Greedy unless said.", ""]
    if "defaults" in res:
        r = res["defaults"]
        lines += [f"**Shipped pair, {r['prompts']} prompts (held-out stdlib modules + fresh ones), one request at a "
                  f"time, {res['new_tokens']} new tokens, {r['dtype']} (the checkpoint's):**", "",
                  "| configuration | decode tok/s | vs AR | whole tok/s | acceptance | same tokens as AR |",
                  "|---|---|---|---|---|---|"]
        for n, x in r["rows"].items():
            ratio = x.get("speedup_vs_f32_ar", x["speedup"])
            acc = "" if x["acceptance"] is None else f"{x['acceptance']:.2f}"
            lines.append(f"| {n} | {x['tok_s']:.0f} [{x['q1']:.0f}-{x['q3']:.0f}] | {ratio:.2f}x | "
                         f"{x['whole_request_tok_s']:.0f} | {acc} | {x['same_as_base'] if 'float32' not in n else ''} |")
        lines.append("")
    if "ngram" in res:
        r = res["ngram"]
        lines += [f"**Prompt lookup on {r['model']} ({r['dtype']}, {r['quantization']}), greedy, "
                  f"{res['ngram_tokens']} new tokens:**", "", "| workload | plain tok/s | ngram tok/s | speedup | "
                  "acceptance |", "|---|---|---|---|---|"]
        for w, rows in r["workloads"].items():
            p, g = rows["plain (AR)"], rows["ngram"]
            acc = "" if g["acceptance"] is None else f"{g['acceptance']:.2f}"
            lines.append(f"| {w} | {p['tok_s']:.0f} | {g['tok_s']:.0f} | {g['speedup']:.2f}x | {acc} |")
        lines.append("")
    if "sampled" in res:
        lines += ["**Temperature 1, shipped pair, 4 prompts:**", "", "| proposer | tok/s | vs AR | acceptance |",
                  "|---|---|---|---|"]
        for n, x in res["sampled"]["rows"].items():
            acc = "" if x["acceptance"] is None else f"{x['acceptance']:.2f}"
            lines.append(f"| {n} | {x['tok_s']:.0f} | {x['speedup']:.2f}x | {acc} |")
        lines.append("")
    if "load" in res:
        lines += [f"**Engine under load, shipped pair, greedy, {res['load_tokens']} tokens per request, auto K. Steady: c "
                  f"requests in flight, each replaced when it finishes, {res.get('load_waves', 4)} per client; one batch: "
                  "c requests admitted together. Wall-clock generated tokens per second, prefill included:**", "",
                  "| concurrency | plain tok/s (steady) | spec tok/s (steady) | spec / plain: medians | best of "
                  f"{res['repeats']} | one batch | last round (K, rows drafting) |",
                  "|---|---|---|---|---|---|---|"]
        for c, rows in res["load"].items():
            p, s = rows["plain"], rows["spec auto"]
            lines.append(f"| {c} | {p['tok_s']:.0f} [{p['q1']:.0f}-{p['q3']:.0f}] | {s['tok_s']:.0f} "
                         f"[{s['q1']:.0f}-{s['q3']:.0f}] | {s['tok_s'] / p['tok_s']:.2f}x | "
                         f"{s['best_tok_s'] / p['best_tok_s']:.2f}x | "
                         f"{s['one_batch_tok_s'] / p['one_batch_tok_s']:.2f}x | {s['k_last']} |")
    lines += ["", "Reproduce: `python benchmarks/speculation.py`."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--ngram-tokens", type=int, default=160)
    ap.add_argument("--load-tokens", type=int, default=64)
    ap.add_argument("--load-waves", type=int, default=4, help="requests per client in the steady load test")
    ap.add_argument("--only", default="defaults,ngram,sampled,load")
    a = ap.parse_args()
    torch.manual_seed(0)
    settings = {"benchmark": "speculation", "machine": machine(), "repeats": a.repeats, "new_tokens": a.new_tokens,
                "ngram_tokens": a.ngram_tokens, "load_tokens": a.load_tokens, "load_waves": a.load_waves}
    parts = {"defaults": part_defaults, "ngram": part_ngram, "sampled": part_sampled, "load": part_load}
    only = a.only.split(",")
    # a partial run updates its parts in the last results and keeps the others (each part records when it ran)
    old = RESULTS / "speculation.json"
    res = json.loads(old.read_text()) if set(only) != set(parts) and old.exists() else {}
    res.update(settings)
    for name in only:
        res[name] = parts[name](a)
        res.setdefault("ran_at", {})[name] = time.strftime("%Y-%m-%d %H:%M")
        print(name, "done", flush=True)
    write_json("speculation", res)
    update_doc_section("speculation", render(res))
    print(render(res))


if __name__ == "__main__":
    main()
