"""A datastore of SmolLM2's own answers as a source of copies (REST, He et al. 2023), beside the defaults (issue 33).

    python benchmarks/datastore.py [--temperatures 0 0.7] [--prompts 6] [--passes 2] [--render]

The drafter data (data/drafter-answers, data/drafter-magpie: the target's answers to the training prompts, ~3.3M
tokens) indexed as a suffix array (every position's next 8 tokens, sorted): a context's longest suffix of up to 7
tokens found in it, its most frequent continuation followed while the product of the continuations' shares stays
above a floor, as the suffix tree drafts. Two readings, both on the held-out prompts (never in that data):

1. Replay: the plain engine's own outputs (256 tokens at each temperature); at every position the store's first draft
   against the token the target produced, binned by the match's length, how many continuations it had and the top
   one's share: how often a copy is offered and how often it is right.
2. In the engine: the defaults (the suffix tree's copies beside the EAGLE-3 head, auto K) against the same engine
   whose copier also offers the store's draft where it expects more accepted tokens than the tree's (its
   confidences calibrated by auto K in groups of their own, by match length), beside plain decoding, prompts and
   variants rotating (common.paired_passes). The lookup is numpy here (~50-100 us a step); the "less lookup" column
   takes its time out, what a C++ lookup would leave.

Checked, not shipped (docs/benchmarks.md, "datastore"): the head was trained on this very data, and a copy from it is
right where the head already is. Writes benchmarks/results/datastore.json and the "datastore" section.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import sys
import time
import weakref
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, paired_passes, quartiles, results_of, update_doc_section  # noqa: E402

SEP = 65535  # between answers (no token id: SmolLM2's vocabulary is 49,152)
W = 8  # tokens a key holds: matches of up to W - 1, so that a continuation is in the key


class Store:
    """Every position of the corpus by its next W tokens, sorted (a suffix array cut at W tokens)."""

    def __init__(self, seqs: list[list[int]]):
        toks = [t for s in seqs for t in (*s, SEP)]
        n = len(toks)
        self.tokens = np.array(toks + [SEP] * W, dtype=np.uint16)
        # big-endian uint16 keys compare as byte strings in token order
        keys = self.tokens[np.arange(n)[:, None] + np.arange(W)[None, :]].astype(">u2")
        kb = np.frombuffer(np.ascontiguousarray(keys).tobytes(), dtype=f"S{2 * W}")
        order = np.argsort(kb, kind="stable")
        self.pos, self.keys, self.size = order, kb[order], n

    def _range(self, ctx: list[int]) -> tuple[int, int]:
        b = np.array(ctx, dtype=">u2").tobytes()
        return (int(np.searchsorted(self.keys, b, "left")),
                int(np.searchsorted(self.keys, b + b"\xff" * (2 * (W - len(ctx))), "right")))

    def draft(self, ctx: list[int], k: int, min_prob: float, min_match: int, smooth: float,
              max_range: int = 50_000) -> tuple[list[int], list[tuple[float, int, int]]]:
        """Up to k drafts -> (drafts, per draft (its share among the continuations, the match's length, how many
        continuations)); a share is count / (continuations + smooth), so one occurrence is no certainty."""
        out, info, p = [], [], 1.0
        ctx = list(ctx[-(W - 1):])
        while len(out) < k:
            found = None
            for m in range(min(W - 1, len(ctx)), min_match - 1, -1):
                if SEP not in ctx[-m:]:
                    lo, hi = self._range(ctx[-m:])
                    if hi > lo:
                        found = (m, lo, hi)
                        break
            if found is None or found[2] - found[1] > max_range:
                break
            m, lo, hi = found
            nxt = self.tokens[self.pos[lo:hi] + m]  # sorted: the range shares its first m tokens
            nxt = nxt[nxt != SEP]
            if not len(nxt):
                break
            edges = np.flatnonzero(np.diff(nxt)) + 1
            starts, ends = np.concatenate(([0], edges)), np.concatenate((edges, [len(nxt)]))
            i = int(np.argmax(ends - starts))
            share = float(ends[i] - starts[i]) / (len(nxt) + smooth)
            if p * share < min_prob:
                break
            p *= share
            out.append(int(nxt[starts[i]]))
            info.append((share, m, len(nxt)))
            ctx = (ctx + [out[-1]])[-(W - 1):]
        return out, info


def corpus() -> list[list[int]]:
    files = sorted(glob.glob(str(ROOT / "data/drafter-answers/*.gz"))) + \
        sorted(glob.glob(str(ROOT / "data/drafter-magpie/*.gz")))
    return [json.loads(line)["answer_ids"] for f in files for line in gzip.open(f)]


def replay(store: Store, outputs: list[dict]) -> dict:
    """First drafts against the target's own tokens, binned (match length, continuations, top share)."""
    bins: dict = defaultdict(lambda: [0, 0])
    positions: dict = defaultdict(int)
    for e in outputs:
        full, P = e["prompt_ids"] + e["output_ids"], len(e["prompt_ids"])
        for i in range(P, len(full)):
            positions[e["temperature"]] += 1
            d, info = store.draft(full[:i], 1, 0.0, 2, 0.0)
            if d:
                share, m, n = info[0]
                key = (e["temperature"], min(m, 7), 0 if n == 1 else 1 if n < 4 else 2 if n < 16 else 3,
                       0 if share < 0.5 else 1 if share < 0.95 else 2)
                bins[key][0] += 1
                bins[key][1] += d[0] == full[i]
    return {"positions": {str(t): n for t, n in positions.items()},
            "bins": [{"temperature": k[0], "match": k[1], "continuations": ["1", "2-3", "4-15", "16+"][k[2]],
                      "share": ["<0.5", "0.5-0.95", ">=0.95"][k[3]], "n": v[0], "right": v[1]}
                     for k, v in sorted(bins.items())]}


def with_store(store: Store, min_prob: float, min_match: int, smooth: float, spent: list):
    """SuffixProposer's batch lookup, also asking the store: its draft replaces the tree's where it expects more
    accepted tokens (sum of the products of the shares); its confidences filed in groups 8 + match length - 3."""
    from infer.proposers import suffix as sx

    tree_lookup = sx.SuffixProposer._lookup_rows
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def expect(conf):
        e, alive = 0.0, 1.0
        for c in conf:
            alive *= c
            e += alive
        return e

    def lookup_rows(self, reqs, ks):
        out = tree_lookup(self, reqs, ks)
        t0 = time.perf_counter()
        for b, (req, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                continue
            hit = memo.get(req)
            if hit is None or hit[0] != req.num_tokens or k > hit[1]:
                d, info = store.draft(req.token_slice(max(0, req.num_tokens - W + 1)), k, min_prob, min_match, smooth)
                hit = memo[req] = (req.num_tokens, k, d, [s for s, _, _ in info],
                                   8 + min(info[0][1], 7) - min_match if info else 8)
            d, conf, group = hit[2][:k], hit[3][:k], hit[4]
            if d and expect(conf) > expect(out[b][1]):
                out[b] = (d, conf, group)
                row = self._rows.get(req)
                row.memo = (row.fed, k, list(d), list(conf), group)  # the proposal then copies these drafts
        spent[0] += time.perf_counter() - t0
        return out

    return tree_lookup, lookup_rows


def plain_outputs(plain, ids: list, kinds: list, temperatures: list[float]) -> list[dict]:
    from infer import SamplingParams

    out = []
    for t in temperatures:
        for kind, x, o in zip(kinds, ids, plain.generate(ids, SamplingParams(temperature=t, max_tokens=256, seed=1))):
            out.append({"kind": kind, "temperature": t, "prompt_ids": x, "output_ids": list(o.token_ids)})
    return out


def run(args) -> dict:
    from infer import LLM
    from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation
    from infer.drafters import eval_prompts
    from infer.proposers import suffix as sx

    t0 = time.perf_counter()
    store = Store(corpus())
    build_s = time.perf_counter() - t0
    plain = LLM(real_model_path(), **REAL_MODEL_SETTINGS, max_batch_size=1, compile_in_background=False)
    spec = LLM(real_model_path(), **real_model_speculation(), **REAL_MODEL_SETTINGS, max_batch_size=1,
               compile_in_background=False)
    tok = plain.tokenizer
    ps = eval_prompts()
    every = [("chat", p) for p in ps["chat"]] + [("code", p) for p in ps["code"]]
    all_ids = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for _, p in every]
    res = {"machine": machine(), "corpus_tokens": store.size, "build_s": build_s,
           "store": {"min_prob": args.min_prob, "min_match": args.min_match, "smooth": args.smooth},
           "replay": replay(store, plain_outputs(plain, all_ids, [k for k, _ in every], args.temperatures))}
    # the engine A/B on the last prompts of each kind
    ids = all_ids[24 - args.prompts:24] + all_ids[48 - args.prompts:]
    suffix = next(v for v in vars(spec.engine.decoder.proposer).values() if isinstance(v, sx.SuffixProposer))
    spent = [0.0]
    tree_lookup, store_lookup = with_store(store, args.min_prob, args.min_match, args.smooth, spent)
    state = {"current": None, "store_s": []}  # the store's lookup seconds of each of its generations, in order

    def setup(name):
        if state["current"] == "datastore":
            state["store_s"].append(spent[0])
        state["current"], spent[0] = name, 0.0
        sx.SuffixProposer._lookup_rows = store_lookup if name == "datastore" else tree_lookup
        suffix.clear()  # every prompt meets the tree unseen (as benchmarks/drafters.py)

    res["engine"] = {}
    try:
        for t in args.temperatures:
            state.update(current=None, store_s=[])
            runs, counts = paired_passes(plain, spec, ids, ["defaults", "datastore"], setup, args.passes, t, 128)
            setup(None)
            keys = sorted(runs["plain"])  # (pass, prompt): the order each variant's generations ran in
            rate = {n: {k: runs[n][k][1] / runs[n][k][0] for k in keys} for n in runs}
            looked = dict(zip(keys, state["store_s"][len(ids):]))  # the warm-up pass's first
            less = {k: runs["datastore"][k][1] / max(1e-9, runs["datastore"][k][0] - looked[k]) for k in keys}
            res["engine"][str(t)] = {
                "defaults_over_plain": quartiles([rate["defaults"][k] / rate["plain"][k] for k in keys]),
                "datastore_over_plain": quartiles([rate["datastore"][k] / rate["plain"][k] for k in keys]),
                "datastore_over_defaults": quartiles([rate["datastore"][k] / rate["defaults"][k] for k in keys]),
                "datastore_less_lookup_over_defaults": quartiles([less[k] / rate["defaults"][k] for k in keys]),
                "lookup_ms_per_token": 1e3 * sum(looked.values()) / sum(runs["datastore"][k][1] for k in keys),
                "accepted_drafted_rounds": counts,
                "same_tokens": all(runs["datastore"][k][2] == runs["defaults"][k][2] for k in keys) if t == 0 else None}
    finally:
        sx.SuffixProposer._lookup_rows = tree_lookup
    res["prompts"], res["passes"] = args.prompts, args.passes
    return res


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"`python benchmarks/datastore.py` ({m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}). "
             f"SmolLM2-135M-Instruct as `infer chat` runs it (bfloat16 over its Q4_1 blocks, compiled, one request); "
             f"the store: the drafter data's {res['corpus_tokens']:,} answer tokens as a suffix array of 8-token keys "
             f"(built in {res['build_s']:.1f} s), drafts while the product of the shares (count / (continuations + "
             f"{res['store']['smooth']})) stays >= {res['store']['min_prob']}, matches of >= "
             f"{res['store']['min_match']} tokens.", "",
             "**Replay** (the plain engine's outputs to all 48 held-out prompts, 256 tokens; the store's first draft "
             "at every position against the target's token; bins of >= 2% of the positions):", "",
             "| temperature | match | continuations | top share | share of positions | right |",
             "|---|---|---|---|---|---|"]
    pos = res["replay"]["positions"]
    for b in res["replay"]["bins"]:
        frac = b["n"] / pos[str(b["temperature"])]
        if frac >= 0.02:
            lines.append(f"| {b['temperature']} | {b['match']} | {b['continuations']} | {b['share']} | {frac:.3f} | "
                         f"{b['right'] / b['n']:.2f} |")
    n = res["prompts"]
    lines += ["", f"**In the engine** ({n} + {n} held-out prompts x {res['passes']} passes after a warm-up, 128 "
              "tokens, decode tokens/s paired by prompt and pass, median (quartiles)):", "",
              "| temperature | defaults over plain | with the store over plain | with the store over the defaults | "
              "the same, its lookup's time taken out | accepted / drafted / rounds (defaults; with the store) |",
              "|---|---|---|---|---|---|"]
    q = lambda d: f"{d['median']:.3f} ({d['q1']:.3f}-{d['q3']:.3f})"  # noqa: E731
    for t, e in res["engine"].items():
        c = e["accepted_drafted_rounds"]
        lines.append(f"| {t} | {q(e['defaults_over_plain'])} | {q(e['datastore_over_plain'])} | "
                     f"{q(e['datastore_over_defaults'])} | {q(e['datastore_less_lookup_over_defaults'])} | "
                     f"{'/'.join(map(str, c['defaults']))}; {'/'.join(map(str, c['datastore']))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts of each kind (chat, code) in the A/B")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--min-prob", type=float, default=0.6)
    ap.add_argument("--min-match", type=int, default=6)
    ap.add_argument("--smooth", type=float, default=2.0)
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    args = ap.parse_args()
    res = results_of("datastore", args.render, lambda: run(args))
    update_doc_section("datastore", render(res))
    print(json.dumps({t: {k: v for k, v in e.items() if k != "accepted_drafted_rounds"}
                      for t, e in res["engine"].items()}, indent=1))


if __name__ == "__main__":
    main()
