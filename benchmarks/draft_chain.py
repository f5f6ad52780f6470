"""Draft chains on and off in one engine (issue 33's c): an EAGLE head's later draft steps as one compiled chain
(EagleHead.draft_chain) against a step at a time, end to end on SmolLM2.

One engine per drafter setting (SmolLM2-135M-Instruct as `infer chat` runs it: bfloat16 over its GGUF's Q4_1 blocks,
compiled, one request at a time; the EAGLE head alone with auto K, and chat's default hybrid of prompt lookup and the
EAGLE head), its graphs all built before timing (both paths' graphs: the warm-up builds single steps and chains).
Each generation runs with chains on or off (``proposers.eagle.CHAIN_MAX`` 3 or 0), alternating prompt by prompt and
round by round (on, off, off, on, ...), so a slower stretch of the machine hits both; per side the median tokens/s
with quartiles over every generation, greedy and at temperature 0.7 (plain temperature: chains draw too).

    python benchmarks/draft_chain.py [--rounds 3] [--prompts 3] [--new-tokens 128]

Writes benchmarks/results/draft_chain.json and the "draft-chain" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine, quartiles, spread, update_doc_section, write_json
from infer import LLM, SamplingParams
from infer.demo import REAL_MODEL_SETTINGS, real_model_path
from infer.drafters import drafter_paths, eval_prompts
from infer.proposers import eagle

SETTINGS = {"EAGLE head (auto K)": {"proposer": "draft"}, "hybrid (chat's default)": {"proposer": "hybrid"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="per kind (chat, code)")
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    torch.set_num_threads(2)
    prompts = eval_prompts()
    chosen = prompts["chat"][:a.prompts] + prompts["code"][:a.prompts]
    res = {"machine": machine(), "rounds": a.rounds, "new_tokens": a.new_tokens,
           "prompts": [p["prompt"] for p in chosen], "cells": {}}
    for name, spec in SETTINGS.items():
        llm = LLM(str(real_model_path()), **REAL_MODEL_SETTINGS, draft_model=str(drafter_paths()["eagle"]), **spec,
                  max_batch_size=1, compile_in_background=False)
        msgs = [[{"role": "user", "content": p["prompt"]}] for p in chosen]
        for temp in (0.0, 0.7):
            rates = {"chains": [], "step by step": []}
            for m in msgs[:2]:  # untimed: first calls
                llm.chat(m, SamplingParams(temperature=temp, max_tokens=16, seed=0))
            flip = False
            for r in range(a.rounds):
                for m in msgs:
                    for side in (("chains", "step by step") if not flip else ("step by step", "chains")):
                        eagle.CHAIN_MAX = 3 if side == "chains" else 0
                        t0 = time.perf_counter()
                        o = llm.chat(m, SamplingParams(temperature=temp, max_tokens=a.new_tokens, seed=r,
                                                       ignore_eos=True))
                        rates[side].append(len(o.token_ids) / (time.perf_counter() - t0))
                    flip = not flip
            eagle.CHAIN_MAX = 3
            cell = f"{name} T={temp:g}"
            res["cells"][cell] = {k: {**quartiles(v), "rates": v} for k, v in rates.items()}
            c, s = res["cells"][cell]["chains"]["median"], res["cells"][cell]["step by step"]["median"]
            print(f"{cell}: chains {c:.1f} tok/s, step by step {s:.1f} tok/s, {c / s:.3f}x", flush=True)
        del llm
    write_json("draft_chain", res)
    m = res["machine"]
    md = ["## Draft chains on and off (issue 33)", "",
          f"`python benchmarks/draft_chain.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
          "SmolLM2-135M-Instruct as `infer chat` runs it (bfloat16 over its GGUF's Q4_1 blocks, compiled, one request), "
          f"the shipped EAGLE head (Q8_0); {len(chosen)} held-out prompts ({a.prompts} chat, {a.prompts} code) x "
          f"{a.rounds} rounds, {a.new_tokens} new tokens (ignore_eos), in one engine per setting with chains on "
          "(a round's later draft steps as one compiled chain) and off (a step at a time) alternating generation by "
          "generation. Median tokens/s (quartiles).", "",
          "| setting | chains tok/s | step by step tok/s | chains / step by step |", "|---|---|---|---|"]
    for cell, v in res["cells"].items():
        c, s = v["chains"], v["step by step"]
        md.append(f"| {cell} | {spread(c)} | {spread(s)} | {c['median'] / s['median']:.3f}x |")
    update_doc_section("draft-chain", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
