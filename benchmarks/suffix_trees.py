"""Suffix decoding's token trees against its chains, replayed over plain decoding's outputs (issue 35).

    python benchmarks/suffix_trees.py [--inputs 48] [--render]

SuffixProposer drafts a chain, or with ``spec_tree`` a tree: from the chain's match, each node's ``width`` most
frequent children grown best first by the path's probability under the counts (SuffixDecoding's speculation trees).
Whether a tree pays depends on what a verify row costs, so the same outputs are priced two ways:

- **this CPU** (the suffix engine's measured verify costs, results/suffix_calibration.json): auto K's chain of k
  drafts for a lone request (suffix.replay's "groups" rule) against the tree of the k best nodes (what
  ``spec_tree="auto"`` gives a lone request where extra rows cost: the same verify width, the same price);
- **nearly free rows** (a GPU's verify, v(n) = 1 + 0.02 n decode steps for n drafts): the chain of up to 8 drafts
  against a tree of depth <= 8, width 3, 15 nodes.

Deterministic (no timing): plain decoding's greedy outputs of benchmarks/suffix.py's loops (SmolLM2-135M-Instruct at
its served setting) and of 12 held-out chat prompts, replayed through a fresh SuffixProposer in the loop's order; a
round accepts the longest tree path that matches the output. Writes results/suffix_trees.json and the "suffix-trees"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, results_of, update_doc_section  # noqa: E402
from suffix import WORKLOADS, _Replayed  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402
from infer.proposers.base import DraftBatch  # noqa: E402
from infer.proposers.suffix import SuffixProposer  # noqa: E402
from infer.spec_decode.spec_length import MARGIN, Calibration  # noqa: E402

FREE_ROWS = 0.02  # a verify row's price where rows are nearly free (decode steps a draft)
TREE = (8, 3, 15)  # depth, width, nodes of the tree where rows are nearly free


def _matched(tree, out: list[int]) -> int:
    """Drafts of ``tree`` accepted against the output: the path from the root that matches it longest."""
    n, u = 0, 0
    while n < len(out):
        u = next((i for i in range(1, len(tree.tokens)) if tree.parents[i] == u and tree.tokens[i] == out[n]), 0)
        if not u:
            break
        n += 1
    return n


def tree_replay(prompts, outputs, v, tree: bool, auto: bool) -> dict:
    """Each round: ``auto``: auto K's k for a lone request (calibrated groups, MARGIN), the chain of k drafts or the
    tree of the k best nodes; else the chain of up to TREE[0] drafts or the TREE-shaped tree. Priced v(drafts)."""
    prop, cals, cost, accepted, drafted = SuffixProposer(), {}, 0.0, 0, 0
    depth, width, nodes = TREE
    for prompt, out in zip(prompts, outputs):
        req, i = _Replayed(prompt), 0
        while i < len(out):
            d, conf = prop.lookup(req, depth), prop.draft_confidence(req, depth)
            a = next((j for j, (x, y) in enumerate(zip(d, out[i:])) if x != y), min(len(d), len(out) - i))
            k = len(d)
            if auto:
                cal = cals.setdefault(prop.confidence_group(req, depth), Calibration())
                best, k, e = (1.0 + MARGIN) / v(0), 0, cal.curve(conf, len(conf))
                for j in range(1, len(conf) + 1):
                    if e[j] / v(j) > best:
                        best, k = e[j] / v(j), j
                for j in range(min(a + 1, k)):
                    cal.observe(conf[j], j < a)
            n, got = k, min(a, k)
            if tree and k:
                batch = DraftBatch([req], [k], None, None, [None], 0, torch.device("cpu"))
                t = prop.propose_tree(batch, width)[0].prune(k if auto else nodes, k)
                n, got = len(t) - 1, min(_matched(t, out[i:]), len(out) - i)
            cost, accepted, drafted = cost + v(n), accepted + got, drafted + n
            step = min(got + 1, len(out) - i)
            req.output_ids += out[i:i + step]
            i += step
        prop.finished(req)
    return {"speed": sum(map(len, outputs)) / cost, "accepted": accepted, "drafted": drafted}


def run(a) -> dict:
    llm = LLM(real_model_path(), max_batch_size=1, **REAL_MODEL_SETTINGS, compile_in_background=False)
    loops = {name: prompts[:a.inputs] for name, prompts in WORKLOADS.items()}
    loops["chat"] = [p["prompt"] for p in eval_prompts()["chat"]][:12]
    stored = json.loads((RESULTS / "suffix_calibration.json").read_text())["workloads"]
    res = {"machine": machine(), "inputs": a.inputs, "free_row": FREE_ROWS, "tree": TREE, "workloads": {}}
    for name, prompts in loops.items():
        ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outs = [list(llm.generate([x], SamplingParams(temperature=0.0, max_tokens=160))[0].token_ids) for x in ids]
        cpu = stored.get(name, stored["JSON extraction"])["verify"]  # the suffix engine's v(k), k = 0..8

        def v_cpu(n):
            return cpu[min(n, len(cpu) - 1)]

        def v_free(n):
            return 1.0 + FREE_ROWS * n
        res["workloads"][name] = {
            "cpu": {"chain": tree_replay(ids, outs, v_cpu, False, True),
                    "tree": tree_replay(ids, outs, v_cpu, True, True)},
            "free rows": {"chain": tree_replay(ids, outs, v_free, False, False),
                          "tree": tree_replay(ids, outs, v_free, True, False)}}
        print(name, json.dumps(res["workloads"][name]), flush=True)
    llm.close()
    return res


def render(res: dict) -> None:
    m = res["machine"]
    d, w, n = res["tree"]
    lines = [f"`python benchmarks/suffix_trees.py` ({m['cpu']}, {m['date']}): plain decoding's greedy outputs "
             f"(SmolLM2-135M-Instruct Q4_1, up to 160 tokens; the loops' first {res['inputs']} inputs, 12 held-out "
             "chat prompts) replayed through a fresh suffix proposer; predicted decode speed over plain, accepted drafts / "
             "drafts verified. \"this CPU\": auto K's chain of k against the tree of the k best nodes, priced with the "
             "suffix engine's measured verify costs; \"nearly free rows\": v(n) = 1 + "
             f"{res['free_row']} n, the chain of up to {d} against a tree of depth {d}, width {w}, {n} nodes.", "",
             "| workload | this CPU: chain | this CPU: tree | nearly free rows: chain | nearly free rows: tree |",
             "|---|---|---|---|---|"]
    for name, r in res["workloads"].items():
        cells = [f"{x['speed']:.3f}x ({x['accepted']} / {x['drafted']})"
                 for x in (r["cpu"]["chain"], r["cpu"]["tree"], r["free rows"]["chain"], r["free rows"]["tree"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    update_doc_section("suffix-trees", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=48, help="the loops' length")
    ap.add_argument("--render", action="store_true", help="only redraw the docs section from the JSON")
    a = ap.parse_args()
    if not 1 <= a.inputs <= 48:
        ap.error(f"--inputs must be 1..48, got {a.inputs}")
    res = results_of("suffix_trees", a.render, lambda: run(a))
    render(res)


if __name__ == "__main__":
    main()
