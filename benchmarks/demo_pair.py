"""The shipped demo pair as `infer demo` runs it: its bfloat16 weights against its Q8_0 blocks, plain and speculating.

    python benchmarks/demo_pair.py [--repeats 3] [--new-tokens 128] [--render]

Four engines over the pair (23M target, 1.4M drafter, ``infer.demo``): plain decoding and ``LLM(target,
draft_model=drafter)`` (auto K), each on the checkpoint's bfloat16 weights and on Q8_0 blocks (``quantization="q8_0"``,
the drafter quantized with it: ``draft_quantization="auto"``). Every held-out prompt of the pair (8 stdlib modules it
never saw), greedy, one request at a time, the prefix cache off (each run is a new prompt); per prompt the four run A
B C D, ``--repeats`` times, and each side keeps its best run (a shared machine only slows a run down). Reported: per
setting the median over prompts of tokens/s and of the speculating engine's speedup over plain decoding on the same
weights, its acceptance, and whether its greedy tokens are plain decoding's. Writes benchmarks/results/demo_pair.json
and the "demo-pair" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, results_of, update_doc_section  # noqa: E402

SETTINGS = {"bfloat16": {"quantization": None}, "Q8_0": {"quantization": "q8_0"}}


def run(repeats: int, new_tokens: int) -> dict:
    from infer import LLM, SamplingParams
    from infer.demo import demo_model_paths, demo_prompts

    target, drafter = demo_model_paths()
    engines = {}
    for name, kw in SETTINGS.items():
        engines[f"plain {name}"] = LLM(target, enable_prefix_caching=False, **kw)
        spec = engines[f"spec {name}"] = LLM(target, draft_model=drafter, enable_prefix_caching=False, **kw)
        spec.engine.wait_until_ready()  # its cost profile measured alone (a first start)
    tok = engines["plain bfloat16"].tokenizer
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    rows = []
    for p in demo_prompts():
        ids = tok.encode(p["prompt"])
        best, outs = {}, {}
        for _ in range(repeats):
            for name, llm in engines.items():
                t0 = time.perf_counter()
                out = llm.generate([ids], params)[0]
                seconds = time.perf_counter() - t0
                best[name] = min(best.get(name, float("inf")), seconds)
                outs[name] = out
        row = {"module": p["module"]}
        for name in engines:
            row[f"{name} tok/s"] = len(outs[name].token_ids) / best[name]
        for s in SETTINGS:
            row[f"{s} speedup"] = row[f"spec {s} tok/s"] / row[f"plain {s} tok/s"]
            row[f"{s} acceptance"] = outs[f"spec {s}"].acceptance_rate or 0.0
            row[f"{s} identical"] = outs[f"spec {s}"].token_ids == outs[f"plain {s}"].token_ids
        rows.append(row)
        print(p["module"], {k: round(v, 2) for k, v in row.items() if isinstance(v, float)}, flush=True)
    return {"machine": machine(), "repeats": repeats, "new_tokens": new_tokens, "rows": rows}


def render(res: dict) -> str:
    m, rows = res["machine"], res["rows"]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    lines = [f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']} (revision {m['revision']}); the demo "
             f"pair, {len(rows)} held-out prompts, greedy, {res['new_tokens']} new tokens, best of {res['repeats']} "
             "interleaved runs per prompt and engine; medians over prompts.", "",
             "| weights | plain tok/s | speculating tok/s | speedup (median, range) | acceptance | greedy identical |",
             "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        sp = sorted(r[f"{s} speedup"] for r in rows)
        lines.append(f"| {s} | {med(f'plain {s} tok/s'):.0f} | {med(f'spec {s} tok/s'):.0f} | "
                     f"{med(f'{s} speedup'):.2f}x ({sp[0]:.2f}-{sp[-1]:.2f}x) | {med(f'{s} acceptance'):.2f} | "
                     f"{all(r[f'{s} identical'] for r in rows)} |")
    q8 = med("spec Q8_0 tok/s") / med("spec bfloat16 tok/s")
    lines += ["", f"Speculating on Q8_0 blocks runs {q8:.1f}x the bfloat16 speculating engine's tokens/s (medians)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--render", action="store_true", help="only re-render the stored results")
    a = ap.parse_args()
    res = results_of("demo_pair", a.render, lambda: run(a.repeats, a.new_tokens))
    md = render(res)
    update_doc_section("demo-pair", md)
    print(md)


if __name__ == "__main__":
    main()
