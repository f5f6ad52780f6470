"""The first replies of a warm start: a lone request drafting while the warm-up still compiles, or not (issue 33).

    python benchmarks/early_drafts.py [--processes 3] [--seconds 20] [--tag xeon]

A warm start of ``infer chat`` (SmolLM2 as it runs it: bfloat16 over its Q4_1 blocks, one request, the suffix tree
beside the EAGLE-3 head, auto K, a stored cost profile) compiles graphs in a background thread for ~25-80 s
(engine.warmup). A lone request's round needs none of them (the target's one-call steps, the head's one-call round),
so the decoder lets it draft from the first reply (``SpeculativeDecoder.lone_ready``); before, every reply plain
decoded until the warm-up was done. Each process builds that engine and at once sends held-out prompts one after
another (greedy, 128 tokens each) for ``--seconds``; "on" as shipped, "off" with ``lone_ready`` cleared right after
the engine is built (the revision before). Processes alternate on, off, on, off, ... after one process that fills
the caches (its engine waits until ready). Per process: the decode tok/s over the replies that began before the
warm-up was done (their tokens after the first over their time after it), and when the warm-up finished. Greedy
tokens must match between the modes prompt by prompt. Writes benchmarks/results/early_drafts[-tag].json and the
"early-drafts[-tag]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, update_doc_section, write_json  # noqa: E402


def child(mode: str, seconds: float) -> dict:
    """One process's run (printed as JSON on its last line)."""
    from infer import LLM, SamplingParams
    from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation
    from infer.drafters import eval_prompts

    t_start = time.perf_counter()
    llm = LLM(real_model_path(), max_batch_size=1, **REAL_MODEL_SETTINGS, **real_model_speculation())
    engine = llm.engine
    if mode == "seed":
        engine.wait_until_ready()
        return {"mode": mode}
    if mode == "off":
        engine.decoder.lone_ready = False
    built = time.perf_counter()
    ready_at = []
    if engine.warmup is not None:  # when the warm-up is done, from the engine's construction
        threading.Thread(target=lambda: engine.warmup.wait() and ready_at.append(time.perf_counter() - built),
                         daemon=True).start()
    ep = eval_prompts()
    prompts = [p["prompt"] for pair in zip(ep["chat"], ep["code"]) for p in pair]
    replies = []
    for i, prompt in enumerate(prompts):
        if time.perf_counter() - built > seconds:
            break
        warming = not engine.warmup.ready if engine.warmup is not None else False
        drafted = engine.stats.num_draft_tokens
        out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=128, temperature=0))
        m = out.metrics
        replies.append({"prompt": i, "warming": warming, "tokens": len(out.token_ids),
                        "decode_s": m["finish_time"] - m["first_token_time"],
                        "drafts": engine.stats.num_draft_tokens - drafted, "ids": out.token_ids})
    if engine.warmup is not None:
        engine.warmup.wait()
        while not ready_at:
            time.sleep(0.01)
    return {"mode": mode, "build_s": built - t_start, "replies": replies, "ready_after_s": ready_at[0] if ready_at
            else 0.0}


def warm_speed(run: dict) -> float:
    rs = [r for r in run["replies"] if r["warming"]]
    return sum(r["tokens"] - 1 for r in rs) / sum(r["decode_s"] for r in rs) if rs else float("nan")


def render(data: dict) -> str:
    m = data["machine"]
    lines = [f"`python benchmarks/early_drafts.py` ({m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, "
             f"{data['date']}): SmolLM2-135M-Instruct as `infer chat` runs it (a warm start: caches and cost profile "
             f"stored), held-out prompts sent one after another from the moment the engine is built, greedy, 128 "
             f"tokens, for {data['seconds']:.0f} s; processes alternating. Decode tok/s over the replies that began "
             "while the warm-up was still compiling.", "",
             "| process | on: tok/s while warming (replies) | off: tok/s while warming (replies) | on / off |",
             "|---|---|---|---|"]
    for i, (on, off) in enumerate(zip(data["on"], data["off"])):
        a, b = warm_speed(on), warm_speed(off)
        n_on = sum(r["warming"] for r in on["replies"])
        n_off = sum(r["warming"] for r in off["replies"])
        lines.append(f"| {i + 1} | {a:.1f} ({n_on}) | {b:.1f} ({n_off}) | {a / b:.2f}x |")
    ratios = [warm_speed(a) / warm_speed(b) for a, b in zip(data["on"], data["off"])]
    lines += ["", f"Median on / off: **{statistics.median(ratios):.2f}x**. Greedy tokens the same prompt by prompt: "
              f"{data['same_tokens']}. The warm-up done after (from the engine built; on / off, medians): "
              f"{statistics.median(r['ready_after_s'] for r in data['on']):.1f} s / "
              f"{statistics.median(r['ready_after_s'] for r in data['off']):.1f} s."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=3, help="processes of each mode")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long each process sends prompts")
    ap.add_argument("--tag", default="", help="a suffix for the results and the section (a host)")
    ap.add_argument("--child", choices=["on", "off", "seed"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.seconds)))
        return

    def spawn(mode: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--seconds", str(a.seconds)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    spawn("seed")
    runs = {"on": [], "off": []}
    for i in range(2 * a.processes):
        mode = ("on", "off")[i % 2]
        runs[mode].append(spawn(mode))
        r = runs[mode][-1]
        print(mode, f"{warm_speed(r):.1f} tok/s while warming over", sum(x["warming"] for x in r["replies"]),
              "replies", file=sys.stderr)
    same = all(x["ids"] == y["ids"] for on in runs["on"] for off in runs["off"]
               for x in on["replies"] for y in off["replies"] if x["prompt"] == y["prompt"])
    data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": a.seconds,
            "same_tokens": same, **runs}
    name = "early_drafts" + (f"-{a.tag}" if a.tag else "")
    write_json(name, data)
    update_doc_section(name.replace("_", "-"), f"## A warm start's first replies, drafting or not: {name}\n\n" +
                       render(data))
    print(render(data))


if __name__ == "__main__":
    main()
