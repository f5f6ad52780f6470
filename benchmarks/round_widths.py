"""Where a step's time goes, in place, by the width of its target forward (issue 33's v, c and the rest).

    python benchmarks/round_widths.py [--passes 4] [--prompts 4] [--tag T]

SmolLM2-135M-Instruct as `infer chat` runs it (bfloat16 over its GGUF's Q4_1 blocks, compiled, one request): a plain
engine and the defaults' speculating engine (the suffix tree, else the EAGLE-3 head, auto K), the engines alternating
pass by pass after a warm-up pass; held-out prompts (half chat, half code) x 160 tokens, greedy and at 0.7. A
proposer that learns across requests is emptied before each generation. Every decode step is timed as it runs, and
inside it the target's forward, its logits, the proposal (and in it the head's one C++ call), auto K's choice, and
the rest (verification, rollback, emission, the engine's own loop); steps are grouped by the forward's width T (1: a
plain step; T: a verify of T - 1 drafts). Per width: the medians, the tokens a step emitted, and its tokens a
millisecond over a plain engine's step. The cost model prices verify widths from its own profile; this says what
they cost between the other work of a round, weights and head cold.
Writes benchmarks/results/round_widths[-T].json and the "round-widths[-T]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import defaults_beside_plain, machine, update_doc_section, write_json  # noqa: E402

PHASES = ("forward", "logits", "propose", "head", "choose")
MAX_WIDTH = 16  # a decode step's forward is at most k_max + 1 wide; a chat prompt's prefill is wider


def instrument(llm, tag: str, box: dict) -> None:
    """Time ``llm``'s decode steps into ``box["into"][(tag, T)][phase]`` (ms lists: "step", "tokens" and the PHASES),
    while ``box["into"]`` is not None. A prompt's prefill (a forward wider than any verify) is left out."""
    eng, cur = llm.engine, {}

    def timed(obj, name: str, phase: str) -> None:
        f = getattr(obj, name)

        def g(*a, **kw):
            t0 = time.perf_counter()
            out = f(*a, **kw)
            cur[phase] = cur.get(phase, 0.0) + time.perf_counter() - t0
            if phase == "forward":  # runner.forward(model, pool, slots, rows): one row's tokens
                rows = a[3] if len(a) > 3 else kw.get("rows")
                cur["T"] = len(rows[0]) if rows is not None and len(rows) == 1 else None
            return out
        setattr(obj, name, g)

    timed(eng.runner, "forward", "forward")
    timed(eng.runner.model, "compute_logits", "logits")
    if eng.decoder is not None:
        timed(eng.decoder.proposer, "propose", "propose")
        timed(eng.decoder.spec_length, "choose", "choose")
        head = getattr(getattr(eng.decoder.proposer, "model", None), "head", None)
        if head is not None and hasattr(head, "native_round"):
            timed(head, "native_round", "head")
    step = eng.step

    def timed_step(*a, **kw):
        cur.clear()
        t0 = time.perf_counter()
        outs = step(*a, **kw)
        dt = time.perf_counter() - t0
        if box["into"] is not None and cur.get("T") and cur["T"] <= MAX_WIDTH:
            row = box["into"][(tag, cur["T"])]
            row["step"].append(dt * 1e3)
            row["tokens"].append(len(outs))
            for p in PHASES:
                row[p].append(cur.get(p, 0.0) * 1e3)
        return outs
    eng.step = timed_step


def run(passes: int, per_kind: int) -> dict:
    from infer import SamplingParams

    prompts, plain, spec = defaults_beside_plain(per_kind)
    msgs = [[{"role": "user", "content": p}] for _, p in prompts]
    res = {"machine": machine(), "prompts": len(msgs), "passes": passes, "new_tokens": 160, "temperatures": {}}
    box: dict = {"into": None}
    instrument(plain, "plain", box)
    instrument(spec, "spec", box)

    def generation(llm, m, sp) -> None:
        if llm.engine.decoder is not None:  # the suffix tree starts each prompt empty (benchmarks/drafters.py)
            getattr(llm.engine.decoder.proposer, "clear", lambda: None)()
        llm.chat(m, sp)

    for temp in (0.0, 0.7):
        sp = SamplingParams(temperature=temp, max_tokens=160, seed=0)
        box["into"] = None  # the warm-up pass, untimed
        for llm in (spec, plain):
            for m in msgs:
                generation(llm, m, sp)
        into = box["into"] = defaultdict(lambda: defaultdict(list))
        for rep in range(passes):
            for llm in ((spec, plain) if rep % 2 == 0 else (plain, spec)):
                for m in msgs:
                    generation(llm, m, sp)
        box["into"] = None
        base = statistics.mean(into[("plain", 1)]["step"])  # tokens a ms: means (a step's tokens are a mean)
        rows = {}
        for (tag, T), d in sorted(into.items()):
            if len(d["step"]) < 10:
                continue
            med = {k: statistics.median(v) for k, v in d.items()}
            rest = statistics.median(s - sum(d[p][i] for p in PHASES if p != "head")
                                     for i, s in enumerate(d["step"]))
            tokens, step = statistics.mean(d["tokens"]), statistics.mean(d["step"])
            rows[f"{tag} T={T}"] = {**med, "rest": rest, "steps": len(d["step"]), "tokens_mean": tokens,
                                    "step_mean": step, "over_plain_step": tokens / step * base}
        res["temperatures"][str(temp)] = rows
        print(temp, {k: round(v["step"], 3) for k, v in rows.items()}, flush=True)
    plain.close()
    spec.close()
    return res


def render(res: dict, name: str) -> None:
    m = res["machine"]
    lines = [f"`python benchmarks/round_widths.py` ({m['cpu']}, {m['cores']} cores, {m['date']}). SmolLM2-135M-Instruct "
             f"as `infer chat` runs it, a plain engine and the defaults' speculating engine alternating; "
             f"{res['prompts']} held-out prompts x {res['new_tokens']} tokens, {res['passes']} recorded passes. Each "
             "decode step timed in place and grouped by its target forward's width T (1: a plain step); medians in "
             "ms; head: the EAGLE-3 head's one call inside the proposal; rest: the step less forward, logits, "
             "proposal and auto K's choice. Tokens: emitted a step (mean); pays: its tokens a ms over the plain "
             "engine's step (means).", "",
             "| temperature | engine, T | steps | step | forward | logits | proposal (head) | choose | rest | tokens "
             "| pays |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, rows in res["temperatures"].items():
        for k, r in rows.items():
            lines.append(f"| {t} | {k} | {r['steps']} | {r['step']:.2f} | {r['forward']:.2f} | {r['logits']:.2f} | "
                         f"{r['propose']:.2f} ({r['head']:.2f}) | {r['choose']:.2f} | {r['rest']:.2f} | "
                         f"{r['tokens_mean']:.2f} | {r['over_plain_step']:.2f}x |")
    update_doc_section(name.replace("_", "-"), "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=4, help="recorded passes per engine (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=4, help="per kind (chat, code)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    name = "round_widths" + (f"-{a.tag}" if a.tag else "")
    res = run(a.passes, a.prompts)
    write_json(name, res)
    render(res, name)


if __name__ == "__main__":
    main()
