"""A batch's verify with rows drafting unequal K: the pads computed (before) against skipped (kernels/rows.h).

    python benchmarks/ragged_verify.py [--repeats 15] [--passes 4] [--render]

A verify pads its rows to the longest's K + 1 tokens. On a 2-core CPU a verify token is compute-bound (~0.2 of a
decode step at one row), so a pad cost what a real token does and one row drafting 8 beside 7 plain rows cost a
forward of 8 x 9 tokens. The CPU kernels now skip the pads past ``attn_meta.lens``, and auto K prices a round by its
real tokens. Two parts, SmolLM2-135M-Instruct at its served setting (bfloat16 over the GGUF's Q4_1 blocks,
compiled), 8 rows of 200 tokens of context:

- **forwards**: target forward + logits + argmax of each batch shape, the pads skipped (what rounds run) and
  computed (``lens`` withheld: the step before), interleaved, medians (ms);
- **engines**: 8 requests at a time, plain decoding against suffix decoding (the engine that drafts for some rows
  and not others), the loops of benchmarks/suffix.py (12 inputs each) and 12 held-out chat prompts, passes
  alternating; tokens/s over the pass, suffix over plain by pass.

Writes results/ragged_verify.json and the "ragged-verify" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine, results_of, update_doc_section  # noqa: E402
from suffix import WORKLOADS  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402

SHAPES = {  # name -> tokens a row (8 rows)
    "8 x 1 (decode)": [1] * 8,
    "8 x 2 (every row drafts 1)": [2] * 8,
    "1 x 9 + 7 x 1 (one row drafts 8)": [9] + [1] * 7,
    "4 x 3 + 4 x 1 (half the rows draft 2)": [3] * 4 + [1] * 4,
    "8 x 9 (every row drafts 8)": [9] * 8,
}
CONTEXT = 200


def forwards(llm, repeats: int) -> dict:
    runner, pool, model = llm.engine.runner, llm.engine.kv.pool, llm.engine.runner.model
    slots = [pool.allocate(CONTEXT + 10) for _ in range(8)]

    def step(rows: list[int], skip: bool) -> None:
        meta = pool.prepare(slots, rows, runner.device)
        if not skip:
            meta.lens = None  # the kernels then compute every pad, as before
        x = torch.ones(8, max(rows), dtype=torch.long)
        hidden = model(x, meta.positions, pool, meta)
        lens = meta.lens if max(rows) > 1 else None
        model.compute_logits(hidden, lens).max(-1).indices.tolist()  # the round's host sync
        for s in slots:
            pool.truncate_to(s, CONTEXT)

    with torch.inference_mode():
        for s in slots:
            runner.forward(model, pool, [s], [[1] * CONTEXT])
        fns = {f"{name}|{mode}": (lambda r=rows, k=(mode == "skipped"): step(r, k))
               for name, rows in SHAPES.items() for mode in ("skipped", "computed")
               if mode == "skipped" or max(rows) > min(rows)}
        for fn in fns.values():  # graphs built, caches warm
            fn(), fn()
        times = interleaved(fns, repeats)
    for s in slots:
        pool.free(s)
    out = {}
    for key, ts in times.items():
        name, mode = key.split("|")
        out.setdefault(name, {})[mode] = 1e3 * statistics.median(ts)
    return out


def engines(passes: int) -> dict:
    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    llms = {"plain": LLM(real_model_path(), max_batch_size=8, **S),
            "suffix": LLM(real_model_path(), max_batch_size=8, **S, proposer="suffix")}
    for llm in llms.values():
        llm.engine.wait_until_ready()
    loops = {"JSON extraction": WORKLOADS["JSON extraction"][:12], "code edit": WORKLOADS["code edit"][:12],
             "chat (held out)": [p["prompt"] for p in eval_prompts()["chat"]][:12]}
    params = SamplingParams(temperature=0.0, max_tokens=160)
    out = {}
    for wname, prompts in loops.items():
        ids = [llms["plain"].tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        rate, outputs, drafted = {n: [] for n in llms}, {}, 0
        for rep in range(passes + 1):  # pass 0 warms the engines up
            for n in (["plain", "suffix"] if rep % 2 == 0 else ["suffix", "plain"]):
                if llms[n].engine.decoder is not None:
                    llms[n].engine.decoder.proposer.clear()
                t0 = time.perf_counter()
                res = llms[n].generate(ids, params)
                dt = time.perf_counter() - t0
                outputs[n] = [list(o.token_ids) for o in res]
                if rep:
                    rate[n].append(sum(len(o) for o in outputs[n]) / dt)
                    if n == "suffix":
                        drafted += sum(o.num_draft_tokens for o in res)
        by_pass = [s / p for s, p in zip(rate["suffix"], rate["plain"])]
        out[wname] = {"plain": statistics.median(rate["plain"]), "suffix": statistics.median(rate["suffix"]),
                      "by_pass": by_pass, "same_tokens": outputs["plain"] == outputs["suffix"],
                      "drafts_per_token": drafted / (passes * sum(len(o) for o in outputs["suffix"]))}
    for llm in llms.values():
        llm.close()
    return out


def run(a) -> dict:
    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    llm = LLM(real_model_path(), max_batch_size=8, **S, proposer="suffix", spec_length=8)
    llm.engine.wait_until_ready()
    fw = forwards(llm, a.repeats)
    llm.close()
    return {"machine": machine(), "settings": S, "context": CONTEXT, "repeats": a.repeats, "passes": a.passes,
            "forwards": fw, "engines": engines(a.passes)}


def render(res: dict) -> None:
    m = res["machine"]
    lines = [f"`python benchmarks/ragged_verify.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             "SmolLM2-135M-Instruct, bfloat16 over its GGUF's Q4_1 blocks, compiled; 8 rows of "
             f"{res['context']} tokens of context. Forwards: target forward + logits + argmax, {res['repeats']} "
             "interleaved rounds, medians (ms); \"pads computed\" withholds `attn_meta.lens` (the step before).", "",
             "| batch (8 rows) | pads skipped (ms) | pads computed (ms) | over a decode step |", "|---|---|---|---|"]
    decode = res["forwards"]["8 x 1 (decode)"]["skipped"]
    for name, r in res["forwards"].items():
        comp = f"{r['computed']:.2f}" if "computed" in r else "-"
        lines.append(f"| {name} | {r['skipped']:.2f} | {comp} | {r['skipped'] / decode:.2f}x |")
    lines += ["", f"Engines, 8 requests at a time, greedy, 160 tokens, {res['passes']} passes alternating (a warm-up "
              "pass first): tokens/s over the pass (medians), suffix decoding over plain decoding by pass.", "",
              "| loop | plain tok/s | suffix tok/s | suffix / plain by pass | median | drafts per token | same tokens |",
              "|---|---|---|---|---|---|---|"]
    for name, r in res["engines"].items():
        lines.append(f"| {name} | {r['plain']:.1f} | {r['suffix']:.1f} | "
                     f"{', '.join(f'{x:.3f}' for x in r['by_pass'])} | {statistics.median(r['by_pass']):.3f}x | "
                     f"{r['drafts_per_token']:.2f} | {r['same_tokens']} |")
    update_doc_section("ragged-verify", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds of the forwards")
    ap.add_argument("--passes", type=int, default=4, help="passes of each loop per engine")
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    a = ap.parse_args()
    if a.repeats < 1 or a.passes < 1:
        ap.error("--repeats and --passes must be >= 1")
    render(results_of("ragged_verify", a.render, lambda: run(a)))


if __name__ == "__main__":
    main()
