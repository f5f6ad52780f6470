"""The first replies of a warm start: a lone request drafting while the warm-up still compiles, or not (issue 33).

    python benchmarks/early_drafts.py [--processes 3] [--seconds 20] [--tag xeon]

A warm start of ``infer chat`` (SmolLM2 as it runs it: bfloat16 over its Q4_1 blocks, one request, the suffix tree
beside the EAGLE-3 head, auto K, a stored cost profile) compiles graphs in a background thread for ~25-80 s
(engine.warmup). A lone request's round needs none of them (the target's one-call steps, the head's one-call round),
so the decoder lets it draft from the first reply (``SpeculativeDecoder.lone_ready``), and the warm-up thread runs
at a lower priority (``warmup.WARMUP_NICE``); before, every reply plain decoded until the warm-up was done, beside a
thread of the engine's priority. Each process builds that engine and at once sends held-out prompts one after
another (greedy, 128 tokens each) for ``--seconds``: "after" as shipped, "before" with both undone (``lone_ready``
cleared right after the engine is built, the thread at the engine's priority), "nice" with the priority alone.
Processes rotate after, before, nice, ... after one process that fills the caches (its engine waits until ready).
Per process: the decode tok/s over the replies that began before the warm-up was done (their tokens after the first
over their time after it), and when the warm-up finished. Greedy tokens must match between the modes prompt by
prompt. Writes benchmarks/results/early_drafts[-tag].json and the
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
    from infer.engine import warmup

    if mode == "before":
        warmup.WARMUP_NICE = 0  # the warm-up thread at the engine's priority, as before
    t_start = time.perf_counter()
    llm = LLM(real_model_path(), max_batch_size=1, **REAL_MODEL_SETTINGS, **real_model_speculation())
    engine = llm.engine
    if mode == "seed":
        engine.wait_until_ready()
        return {"mode": mode}
    if mode in ("before", "nice"):
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


MODES = ("after", "before", "nice")


def render(data: dict) -> str:
    m = data["machine"]
    lines = [f"`python benchmarks/early_drafts.py` ({m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, "
             f"{data['date']}): SmolLM2-135M-Instruct as `infer chat` runs it (a warm start: caches and cost profile "
             f"stored), held-out prompts sent one after another from the moment the engine is built, greedy, 128 "
             f"tokens, for {data['seconds']:.0f} s; processes rotating after, before, nice. Decode tok/s over the "
             "replies that began while the warm-up was still compiling (replies in brackets), and when it was done.",
             "", "| round | after | before | nice only | after / before | nice / before |", "|---|---|---|---|---|---|"]
    for i, runs in enumerate(zip(*(data[k] for k in MODES))):
        sp = [warm_speed(r) for r in runs]
        cells = [f"{x:.1f} ({sum(y['warming'] for y in r['replies'])}; ready {r['ready_after_s']:.0f} s)"
                 for x, r in zip(sp, runs)]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {sp[0] / sp[1]:.2f}x | {sp[2] / sp[1]:.2f}x |")
    med = {k: statistics.median(warm_speed(r) for r in data[k]) for k in MODES}
    lines += ["", f"Medians: after {med['after']:.1f}, before {med['before']:.1f}, nice only {med['nice']:.1f} tok/s "
              f"(**{med['after'] / med['before']:.2f}x**). Greedy tokens the same prompt by prompt in every mode: "
              f"{data['same_tokens']}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=3, help="processes of each mode")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long each process sends prompts")
    ap.add_argument("--tag", default="", help="a suffix for the results and the section (a host)")
    ap.add_argument("--child", choices=[*MODES, "seed"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.seconds)))
        return

    def spawn(mode: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--seconds", str(a.seconds)],
                             capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            raise RuntimeError(f"{mode}: exit {out.returncode}: {out.stderr[-2000:]}")
        if out.returncode:  # its figures were printed: an exit that failed afterwards is noted, not fatal
            print(f"{mode}: exit {out.returncode} after its results", file=sys.stderr)
        return json.loads(lines[-1])

    spawn("seed")
    runs = {k: [] for k in MODES}
    for i in range(len(MODES) * a.processes):
        mode = MODES[i % len(MODES)]
        runs[mode].append(spawn(mode))
        r = runs[mode][-1]
        print(mode, f"{warm_speed(r):.1f} tok/s while warming over", sum(x["warming"] for x in r["replies"]),
              "replies", file=sys.stderr)
    by_prompt = {}
    for rs in runs.values():
        for r in rs:
            for x in r["replies"]:
                by_prompt.setdefault(x["prompt"], []).append(x["ids"])
    same = all(all(ids == v[0] for ids in v) for v in by_prompt.values())
    data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": a.seconds,
            "same_tokens": same, **runs}
    name = "early_drafts" + (f"-{a.tag}" if a.tag else "")
    write_json(name, data)
    update_doc_section(name.replace("_", "-"), f"## A warm start's first replies: {name}\n\n" + render(data))
    print(render(data))


if __name__ == "__main__":
    main()
