"""How many tokens should the drafter score? Speedup and acceptance against the draft-vocabulary size N.

A draft vocabulary (proposers.draft_vocab, FR-Spec) makes each draft step cheaper (a smaller lm-head GEMV that stays in
cache) but can cost acceptance: a position whose target token lies outside the subset always rejects. This
sweeps N on every held-out prompt of the shipped pair, greedy, one K, interleaved with our autoregressive run:

    python benchmarks/draft_vocab.py [--sizes 0,1024,2048,3072,4096] [--k 6] [--dtype bfloat16+float32]

N = 0 is the full vocabulary (8,192). Each N is also run without the prompt's tokens added ("static"), the way the
batched engine uses it. Greedy outputs are checked identical to autoregressive decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, update_doc_section, write_json  # noqa: E402

from infer.demo import demo_model_paths, demo_prompts  # noqa: E402
from infer.generate import autoregressive_generate  # noqa: E402
from infer.model import load_model  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402
from infer.speculative import speculative_generate  # noqa: E402
from infer.proposers.draft_vocab import DraftVocab, load_ranking  # noqa: E402
from infer.tokenizer import Tokenizer  # noqa: E402


class _Static(DraftVocab):
    """The same subset with nothing added per prompt (what the engine's static draft vocabulary scores)."""

    def including(self, token_ids):
        return self


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0,1024,2048,3072,4096")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16+float32", help="T+D: target dtype + drafter dtype")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t_dtype, _, d_dtype = a.dtype.partition("+")
    tdir, ddir = demo_model_paths()
    target, drafter = load_model(tdir, t_dtype), load_model(ddir, d_dtype or t_dtype)
    tok, ranking = Tokenizer(tdir), load_ranking(ddir)
    info = demo_prompts()
    prompts = [tok.encode(p["prompt"]) for p in info]
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    variants = {"full vocabulary": None}
    for n in (int(s) for s in a.sizes.split(",") if int(s)):
        variants[f"N={n} + prompt"] = DraftVocab.from_ranking(drafter, ranking, n)
        variants[f"N={n} static"] = _Static(drafter.lm_head_weight, ranking[:n])

    times = {v: [[] for _ in prompts] for v in ["AR", *variants]}
    accepted = {v: [0, 0] for v in variants}
    identical = {v: True for v in variants}
    with torch.inference_mode():
        for rep in range(a.repeats + 1):  # repeat 0 warms up
            for i, ids in enumerate(prompts):
                t0 = time.perf_counter()
                ar = autoregressive_generate(target, ids, params, []).output_ids
                if rep:
                    times["AR"][i].append(time.perf_counter() - t0)
                for v, dv in variants.items():
                    t0 = time.perf_counter()
                    out, st = speculative_generate(target, drafter, ids, params, spec_length=a.k, eos_token_ids=[],
                                                   draft_vocab=dv)
                    if rep:
                        times[v][i].append(time.perf_counter() - t0)
                    if rep == 1:
                        accepted[v][0] += sum(r.num_accepted for r in st.rounds)
                        accepted[v][1] += sum(r.tested for r in st.rounds)
                        identical[v] &= out.output_ids == ar
    ar_total = sum(median(t) for t in times["AR"])
    rows = [{"variant": v, "draft_vocab": None if dv is None else dv.size,
             "speedup": ar_total / sum(median(t) for t in times[v]),
             "per_prompt_speedup": [median(times["AR"][i]) / median(times[v][i]) for i in range(len(prompts))],
             "alpha": accepted[v][0] / accepted[v][1], "greedy_identical_to_AR": identical[v]}
            for v, dv in variants.items()]
    res = {"benchmark": "draft_vocab", "machine": machine(), "dtype": a.dtype, "k": a.k, "new_tokens": a.new_tokens,
           "repeats": a.repeats, "prompts": [{"module": p["module"], "tokens": len(ids)} for p, ids in zip(info, prompts)],
           "rows": rows}
    write_json("draft_vocab", res)
    for r in rows:
        print(f"{r['variant']:18s} {r['speedup']:.2f}x alpha {r['alpha']:.3f} identical {r['greedy_identical_to_AR']}")
    write_doc(res)


def write_doc(res):
    m = res["machine"]
    short = [p["module"].rsplit("/", 1)[-1].removesuffix(".py") for p in res["prompts"]]
    lines = [
        "## Draft vocabulary size (issue 4)",
        "",
        f"Greedy, K={res['k']}, {res['dtype']} (target + drafter), all {len(res['prompts'])} held-out prompts, "
        f"{res['new_tokens']} new tokens, {res['repeats']} interleaved repeats after a warm-up, per-prompt medians; "
        f"speedup = our autoregressive time / speculative time, summed over prompts. {m['cpu']}, "
        f"{m['torch_threads']} threads, torch {m['torch']}, {m['date']}. `+ prompt`: the N most frequent training "
        "tokens plus the prompt's own (library loop); `static`: the N alone (the engine's). Greedy outputs "
        "identical to autoregressive for every row: " + str(all(r["greedy_identical_to_AR"] for r in res["rows"])) + ".",
        "",
        "| drafter scores | speedup | alpha | " + " | ".join(short) + " |",
        "|---|---:|---:|" + "---:|" * len(short),
    ]
    for r in res["rows"]:
        lines.append(f"| {r['variant']} | {r['speedup']:.2f}x | {r['alpha']:.3f} | "
                     + " | ".join(f"{s:.2f}" for s in r["per_prompt_speedup"]) + " |")
    lines += ["", "Reproduce: `python benchmarks/draft_vocab.py`."]
    update_doc_section("draft_vocab", "\n".join(lines))


if __name__ == "__main__":
    main()
