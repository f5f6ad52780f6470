"""`infer serve`'s defaults on SmolLM2 under load: C requests at once through one engine, plain against speculation.

    python benchmarks/serve_defaults.py [--concurrency 1,2,4,8] [--temperature 0] [--repeats 6] [--caps 2]

Engines (SmolLM2-135M-Instruct as `infer serve` runs it: bfloat16 over its GGUF's Q4_1 blocks, compiled, the
server's max_batch_size 8), built in one process:
  plain        no drafter
  speculating  the default drafter (suffix-hybrid: the suffix tree's copies beside the EAGLE-3 head, auto K) at
               every batch size
  cap N        the same, rounds only while at most N requests decode (``spec_max_batch_size``: what
               `infer serve` adds, N = demo.SERVE_SPEC_MAX_BATCH)
At concurrency C the engines take the same C held-out prompts (chat and code alternating, 128 tokens, ignore_eos),
all submitted at once, one engine after the other in rotating order; each repeat takes the next C prompts (the
suffix tree is emptied before each generation). Throughput = generated tokens / wall time; per C the median over
repeats of each engine's throughput over plain's in the same repeat. Writes benchmarks/results/serve_defaults.json
and the "serve-defaults" section of docs/benchmarks.md (one table per temperature run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402


def prompts(tok) -> list[list[int]]:
    held = eval_prompts()
    chat, code = [p["prompt"] for p in held["chat"]], [p["prompt"] for p in held["code"]]
    texts = [t for pair in zip(chat, code) for t in pair]  # chat, code alternating
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def run(concurrency: list[int], temperature: float, repeats: int, caps: list[int], max_tokens: int) -> dict:
    settings = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    engines = {"plain": LLM(real_model_path(), **settings),
               "speculating": LLM(real_model_path(), **settings, **real_model_speculation())}
    for cap in caps:
        engines[f"cap {cap}"] = LLM(real_model_path(), **settings, **real_model_speculation(),
                                    spec_max_batch_size=cap)
    for llm in engines.values():
        llm.engine.wait_until_ready()
    ids = prompts(engines["plain"].tokenizer)
    tps: dict[str, dict[int, list[float]]] = {n: {c: [] for c in concurrency} for n in engines}
    offset = 0
    for rep in range(repeats + 1):  # the first a warm-up
        for c in concurrency:
            batch = [ids[(offset + i) % len(ids)] for i in range(c)]
            offset += c
            names = list(engines)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for n in names:
                llm = engines[n]
                proposer = getattr(llm.engine.decoder, "proposer", None) if llm.engine.decoder else None
                getattr(proposer, "clear", lambda: None)()
                t0 = time.perf_counter()
                outs = llm.generate(batch, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                          ignore_eos=True, seed=rep))
                dt = time.perf_counter() - t0
                if rep:
                    tps[n][c].append(sum(len(o.token_ids) for o in outs) / dt)
    rows = []
    for c in concurrency:
        for n in engines:
            ratios = [s / p for s, p in zip(tps[n][c], tps["plain"][c])]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            rows.append({"concurrency": c, "engine": n, "tokens_per_s": statistics.median(tps[n][c]),
                         "over_plain": statistics.median(ratios), "quartiles": [q[0], q[2]],
                         "by_repeat": ratios})
    for llm in engines.values():
        llm.close()
    return {"temperature": temperature, "repeats": repeats, "max_tokens": max_tokens, "rows": rows}


def render(results: dict) -> str:
    m = results["machine"]
    out = [f"`python benchmarks/serve_defaults.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
           f"{results['date']}). SmolLM2-135M-Instruct as `infer serve` runs it (bfloat16 over its GGUF's Q4_1 "
           "blocks, compiled, max_batch_size 8); C held-out prompts (chat and code alternating) submitted at once, "
           "128 tokens each; the engines in one process, in rotating order; throughput over plain decoding's in the "
           "same repeat, median (quartiles) over the repeats."]
    for run_ in results["runs"]:
        out += ["", f"Temperature {run_['temperature']}, {run_['repeats']} repeats:", "",
                "| requests at once | engine | tokens/s | over plain (quartiles) |", "|---|---|---|---|"]
        for r in run_["rows"]:
            out.append(f"| {r['concurrency']} | {r['engine']} | {r['tokens_per_s']:.1f} | {r['over_plain']:.3f}x "
                       f"({r['quartiles'][0]:.3f}-{r['quartiles'][1]:.3f}) |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--caps", default="2", help="spec_max_batch_size values to run beside the uncapped engine")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    a = ap.parse_args()
    path = RESULTS / "serve_defaults.json"
    if not a.render:
        conc = [int(x) for x in a.concurrency.split(",")]
        caps = [int(x) for x in a.caps.split(",") if x]
        results = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                   "runs": [run(conc, t, a.repeats, caps, a.max_tokens) for t in a.temperature]}
        write_json("serve_defaults", results)
    results = json.loads(path.read_text())
    update_doc_section("serve-defaults", render(results))
    print(render(results))


if __name__ == "__main__":
    main()
