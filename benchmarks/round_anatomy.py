"""Where a speculating engine's time goes, round by round, beside a plain engine (issues 33, 35).

    python benchmarks/round_anatomy.py [--passes 2] [--workloads defaults-0 defaults-0.7 suffix-json]

Every engine step is timed and sorted by what it did: a plain step (K = 0: the policy chose no drafts, or nothing
matched), a round of k drafts (with the drafts it accepted), or a prefill. Per kind: count, median milliseconds and
accepted drafts a round, and the tokens a millisecond each kind yields (accepted + 1 over its median). Beside them
the cost model the engine priced its K with (``verify_cost(1, T)`` for T = 1..9, the draft steps, the bookkeeping)
and, for the model drafter, where a round's first draft step goes (timers around the proposer's parts). This is what
Leviathan's formula needs (alpha, c, v) measured in the engine itself, on this machine, in one run. Where a
proposer can draft both ways (suffix-hybrid: the tree's copies, the head's drafts), a round's kind says which, and
each kind carries auto K's price for it: the cost model's verify of k + 1 tokens, its bookkeeping and (the head) its
k draft steps, read just before the step, against the step's time.

Workloads: "defaults-T": SmolLM2 as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, compiled, one request)
with its default speculation (the suffix tree's copies, else the EAGLE-3 head; auto K), 8 held-out prompts (4 chat, 4 code) x
128 tokens at temperature T; "suffix-json": the suffix proposer on benchmarks/suffix.py's 48-input JSON loop, greedy
(the tree cleared before each pass). Each beside a plain engine on the same inputs, passes alternating (the first a
warm-up). Writes benchmarks/results/round_anatomy.json and the "round-anatomy" section of docs/benchmarks.md
(with --tag T: round_anatomy-T.json and the "round-anatomy-T" section).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402


def _prices(spec) -> dict | None:
    """What auto K prices each kind of step at, from its cost model now (seconds): the plain step, and a round of k
    drafts as copies (no draft steps) or the model's; None without a cost model."""
    costs = getattr(spec, "costs", None)
    if costs is None:
        return None
    verify = costs.verify_costs(1, costs.k_max + 1)
    plain_o, spec_o = spec.overhead.get((1, False), 0.0), spec.overhead.get((1, True), 0.0)
    return {"plain": verify[1] + plain_o,
            **{f"{k} copy": verify[1 + k] + spec_o for k in range(1, costs.k_max + 1)},
            **{f"{k} model": verify[1 + k] + spec_o + costs.draft_cost(1, k) for k in range(1, costs.k_max + 1)}}


def _timed_steps(llm, into: dict) -> None:
    """Wrap the engine's step: each step's seconds, accepted drafts and price (None: not priced), filed under its
    kind."""
    eng = llm.engine
    step = eng.step
    decoder = eng.decoder
    spec = getattr(decoder, "spec_length", None)
    proposer = getattr(decoder, "proposer", None)
    both = hasattr(proposer, "copies") and hasattr(proposer, "model")  # rounds of copies and of the model's drafts
    used_model = [False]
    if both:
        propose = proposer.propose

        def noted(batch):
            prop = propose(batch)
            used_model[0] = bool(prop.model_steps)
            return prop
        proposer.propose = noted

    def timed():
        st = eng.runner.stats
        d0, a0, f0, pt0 = st.num_draft_tokens, st.num_accepted_tokens, st.num_drafts, st.prompt_tokens
        prices = _prices(spec) if spec is not None else None
        used_model[0] = False
        t0 = time.perf_counter()
        out = step()
        dt = time.perf_counter() - t0
        # a lone request's step is one of: its prompt's prefill, a round of k drafts, or a plain decode step
        k = st.num_draft_tokens - d0
        # how a round drafted: noted per round where the proposer does both, else its one way (the model's, or
        # copies: prompt lookup, the suffix tree)
        how = ("model" if used_model[0] else "copy") if both else \
            "model" if getattr(proposer, "uses_draft_model", False) else "copy"
        if st.prompt_tokens > pt0:
            kind, price = "prefill", None
        elif st.num_drafts > f0:
            kind = f"k={k} " + ("head" if how == "model" else "copy") if both else f"k={k}"
            price = prices and prices.get(f"{k} {how}")
        else:
            kind, price = "plain", prices and prices["plain"]
        into[kind].append((dt, st.num_accepted_tokens - a0, price))
        return out

    eng.step = timed


def _first_step_timers(llm, into: dict) -> None:
    """Timers around the EAGLE proposer's parts (the first draft step's anatomy), where the engine has one."""
    proposer = getattr(llm.engine.decoder, "proposer", None)
    model = getattr(proposer, "model", proposer)
    if type(model).__name__ != "EagleProposer":
        return
    from infer.proposers import base

    def wrap(obj, name, label):
        orig = getattr(obj, name)

        def f(*a, **kw):
            t0 = time.perf_counter()
            r = orig(*a, **kw)
            into[label].append(time.perf_counter() - t0)
            return r
        setattr(obj, name, f)
    wrap(model, "propose", "the model's proposal")
    wrap(model, "_catch_up", "catch-up bookkeeping")
    wrap(model, "_forward", "head forward (a round's first step, where not fused)")
    wrap(base.DraftDrawer, "draw", "eager draw (draft-vocabulary scores, q, draft)")
    wrap(model.head, "draft_round", "fused round (first step, draw and up to 3 more steps: one call)")
    wrap(model.head, "draft_chain", "chain of later steps (one call)")


def run(workload: str, passes: int) -> dict:
    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    if workload.startswith("defaults"):
        temp = float(workload.split("-")[1])
        tok_llm = LLM(real_model_path(), max_batch_size=1, **S)
        held = eval_prompts()
        prompts = [p["prompt"] for p in held["chat"][:4]] + [p["prompt"] for p in held["code"][:4]]
        spec_kw, params = real_model_speculation(), lambda rep: SamplingParams(
            temperature=temp, max_tokens=128, ignore_eos=True, seed=rep)
    else:
        from suffix import WORKLOADS
        tok_llm = LLM(real_model_path(), max_batch_size=1, **S)
        prompts = WORKLOADS["JSON extraction"][:48]
        spec_kw, params = {"proposer": "suffix"}, lambda rep: SamplingParams(temperature=0.0, max_tokens=160)
    llms = {"plain": tok_llm, "speculating": LLM(real_model_path(), max_batch_size=1, **S, **spec_kw)}
    for llm in llms.values():
        llm.engine.wait_until_ready()
    ids = [tok_llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    steps = {n: defaultdict(list) for n in llms}
    parts = defaultdict(list)
    for name, llm in llms.items():
        _timed_steps(llm, steps[name])
    _first_step_timers(llms["speculating"], parts)
    decode = {n: [] for n in llms}
    for rep in range(passes + 1):
        for name, llm in llms.items():
            if rep == 1:
                steps[name].clear()
                parts.clear()
            proposer = getattr(llm.engine.decoder, "proposer", None)
            if hasattr(proposer, "clear"):
                proposer.clear()
            outs = [llm.generate([x], params(rep))[0] for x in ids]
            if rep:
                s = sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outs)
                decode[name].append(sum(len(o.token_ids) - 1 for o in outs) / s)
    spec = llms["speculating"].engine.decoder.spec_length
    costs = spec.costs
    res = {"prompts": len(ids), "passes": passes,
           "decode_tokens_per_s": decode,
           "over_plain": [a / b for a, b in zip(decode["speculating"], decode["plain"])],
           "steps": {n: {kind: {"n": len(v), "median_ms": 1e3 * statistics.median(t for t, _, _ in v),
                                "accepted": statistics.mean(a for _, a, _ in v),
                                "priced_ms": 1e3 * statistics.median(p) if (p := [x for _, _, x in v if x is not None])
                                else None} for kind, v in sorted(kinds.items())}
                     for n, kinds in steps.items()},
           "verify_ms": [1e3 * costs.verify_cost(1, t) for t in range(1, 10)],
           # a round of one draft, then what each further draft adds (rounds of 4: CostModel.draft_cost)
           "draft_ms": [1e3 * costs.draft_cost(1, 1), 1e3 * (costs.draft_cost(1, 4) - costs.draft_cost(1, 1)) / 3],
           "overhead_ms": {("speculating" if k[1] else "plain") + f" B={k[0]}": 1e3 * v
                           for k, v in spec.overhead.items()},
           "first_step_ms": {k: 1e3 * statistics.median(v) for k, v in parts.items()}}
    for llm in llms.values():
        llm.close()
    return res


def render(res: dict, section: str = "round-anatomy") -> None:
    m = res["machine"]
    lines = [f"`python benchmarks/round_anatomy.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             "SmolLM2-135M-Instruct, bfloat16 over its GGUF's Q4_1 blocks, compiled, one request; each engine step "
             "timed and filed by what it did; medians over the recorded passes. tokens / ms = (accepted + 1) / median "
             "(a plain step: 1 / median); \"over a plain step\": that rate times the plain engine's step; \"auto K's price\": "
             "the median of what its cost model priced that kind of step at just before it ran."]
    for wl, r in res["workloads"].items():
        base = r["steps"]["plain"]["plain"]["median_ms"]  # the plain engine's decode step
        lines += ["", f"**{wl}** ({r['prompts']} prompts, {r['passes']} passes): the speculating engine's decode "
                  "over the plain engine's by pass " + ", ".join(f"{x:.2f}x" for x in r["over_plain"])
                  + f"; the plain engine's step {base:.2f} ms.", "",
                  "| speculating engine's step | count | median ms | auto K's price, ms | accepted drafts | tokens / ms "
                  "| over a plain step |",
                  "|---|---|---|---|---|---|---|"]
        for kind, v in r["steps"]["speculating"].items():
            if kind != "prefill":
                rate = (v["accepted"] + 1) / v["median_ms"]
                price = f"{v['priced_ms']:.2f}" if v.get("priced_ms") else "-"
                lines.append(f"| {kind} | {v['n']} | {v['median_ms']:.2f} | {price} | {v['accepted']:.2f} | "
                             f"{rate:.3f} | {rate * base:.2f}x |")
        lines += ["", "Cost model (ms): verify of T = 1..9 tokens " + ", ".join(f"{x:.2f}" for x in r["verify_ms"])
                  + f"; drafts, a round of one / each further one {r['draft_ms'][0]:.2f} / {r['draft_ms'][1]:.2f}; "
                  + "bookkeeping "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["overhead_ms"].items()) + "."]
        if r["first_step_ms"]:
            lines.append("A round's model proposal, median ms: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["first_step_ms"].items()) + ".")
    update_doc_section(section, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2, help="recorded passes per engine (after a warm-up pass)")
    ap.add_argument("--workloads", nargs="+", default=["defaults-0", "defaults-0.7", "suffix-json"])
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    ap.add_argument("--tag", default="", help="a host's own figures: results/round_anatomy-<tag>.json and the "
                    "round-anatomy-<tag> section (untagged: the round-anatomy section)")
    a = ap.parse_args()
    name = "round_anatomy" + (f"-{a.tag}" if a.tag else "")
    section = name.replace("_", "-")
    if a.render:
        return render(json.loads((RESULTS / f"{name}.json").read_text()), section)
    res = {"machine": machine(), "workloads": {}}
    for wl in a.workloads:
        res["workloads"][wl] = run(wl, a.passes)
        print(wl, {k: v for k, v in res["workloads"][wl].items() if k != "steps"}, flush=True)
    write_json(name, res)
    render(res, section)


if __name__ == "__main__":
    main()
