"""Speed after start-up, two revisions of infer side by side: did a change cost tokens/s once the engine is ready?

Each revision is checked out in a git worktree of its own. For each (revision, setting) a fresh process imports infer
from that worktree, loads SmolLM2-135M-Instruct through `LLM` as `infer chat` does, waits until its compiled steps and
cost model are ready (``Engine.wait_until_ready`` where the revision has it; older ones built everything in the
constructor), runs one untimed generation, then times ``--rounds`` generations of each prompt. Processes alternate
(base, head, base, head, ...) so a slower stretch of the machine hits both; per side, the median and quartiles of
all timed generations. Settings: plain decoding (chat's dtype and quantization, no drafter) and chat's default
speculation, greedy and at temperature 0.7 (and, with --settings, a head drafter alone).

    python benchmarks/revisions.py --base cfe538a [--head HEAD] [--repeats 2] [--rounds 3] [--new-tokens 128]
                                   [--settings plain,speculative,eagle]

Writes benchmarks/results/revisions.json and the "revisions" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, quartiles, spread, update_doc_section, write_json  # noqa: E402

PROMPTS = [  # two chat prompts and a code prompt, none of them the drafters' training prompts
    "Explain how a hash table works and when to use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
]

WORKER = r"""
import json, sys, time
import infer
from infer import LLM, SamplingParams
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation
assert infer.__file__.startswith(sys.argv[1]), (infer.__file__, sys.argv[1])  # the revision under test
setting, rounds, new_tokens = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.argv[5])
if setting == "speculative":
    spec = real_model_speculation()
elif setting in ("eagle", "eagle3"):  # a head drafter alone, K auto
    from infer.drafters import drafter_paths
    spec = {"draft_model": str(drafter_paths()[setting]), "proposer": "draft"}
else:
    spec = {}
llm = LLM(real_model_path(), **REAL_MODEL_SETTINGS, **spec, max_batch_size=1)  # one request, as infer chat
if hasattr(llm.engine, "wait_until_ready"):
    llm.engine.wait_until_ready()
temps = [0.0, 0.7] if spec else [0.0]
msgs = [[{"role": "user", "content": p}] for p in prompts]
for t in temps:
    llm.chat(msgs[0], SamplingParams(temperature=t, max_tokens=new_tokens, seed=0))  # untimed
out = {}
for t in temps:
    rates = []
    for r in range(rounds):
        for m in msgs:
            t0 = time.perf_counter()
            o = llm.chat(m, SamplingParams(temperature=t, max_tokens=new_tokens, seed=r, ignore_eos=True))
            rates.append(len(o.token_ids) / (time.perf_counter() - t0))
    out[f"{setting} T={t:g}"] = rates
print("RESULT " + json.dumps(out))
"""


def worktree(rev: str, root: Path) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = root / sha
    subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                   capture_output=True)
    return sha, path


def revision_args(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments of a two-revision comparison (this script, prefill.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the revision before the change")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--repeats", type=int, default=repeats, help="processes per revision (and setting)")
    ap.add_argument("--rounds", type=int, default=3, help="timed runs of each prompt in each process")
    return ap


def remove_worktrees(paths) -> None:
    for path in paths:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


def run_script(script: str, src: Path, *args: str) -> dict:
    """``script`` in a fresh process importing infer from ``src`` (argv: src, *args) -> its "RESULT {json}" line."""
    env = {**os.environ, "PYTHONPATH": str(src), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", script, str(src), *args], env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker for {src} {' '.join(args)[:200]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def run_worker(src: Path, setting: str, a) -> dict:
    return run_script(WORKER, src, setting, str(a.rounds), str(a.new_tokens), json.dumps(PROMPTS))


def main() -> None:
    ap = revision_args(__doc__, repeats=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--settings", default="plain,speculative",
                    help="of plain, speculative (chat's default), eagle, eagle3 (that head alone, K auto)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="infer-revisions-"))
    sides = {}
    try:
        for name, rev in (("base", a.base), ("head", a.head)):
            sha, path = worktree(rev, root)
            sides[name] = {"rev": sha, "src": path / "src", "rates": {}}
        for i in range(a.repeats):
            for setting in a.settings.split(","):
                for name, side in sides.items():
                    got = run_worker(side["src"], setting, a)
                    for cell, rates in got.items():
                        side["rates"].setdefault(cell, []).extend(rates)
                    print(f"#{i + 1} {name} {setting}: " + ", ".join(
                        f"{c} {statistics.median(r):.1f} tok/s" for c, r in got.items()), flush=True)
    finally:
        remove_worktrees(side["src"].parent for side in sides.values())

    cells = list(sides["base"]["rates"])
    res = {"machine": machine(), "base": sides["base"]["rev"], "head": sides["head"]["rev"], "prompts": PROMPTS,
           "new_tokens": a.new_tokens, "repeats": a.repeats, "rounds": a.rounds,
           "cells": {c: {n: {**quartiles(s["rates"][c]), "rates": s["rates"][c]} for n, s in sides.items()}
                     for c in cells}}
    write_json("revisions", res)
    m = res["machine"]
    md = [f"Tokens/s after start-up, revision {res['base']} (base) against {res['head']} (head), SmolLM2-135M-Instruct "
          f"with `infer chat`'s settings (bfloat16, its GGUF's Q4_1 blocks, compiled), one request, {a.new_tokens} new "
          f"tokens, "
          f"{len(PROMPTS)} chat prompts x {a.rounds} rounds x {a.repeats} processes per side, processes interleaved. "
          f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}. Median (quartiles). "
          f"`python benchmarks/revisions.py --base {res['base']} --settings {a.settings}`.", "",
          "| setting | base tok/s | head tok/s | head / base |", "|---|---|---|---|"]
    for c in cells:
        b, h = res["cells"][c]["base"], res["cells"][c]["head"]
        md.append(f"| {c} | {spread(b)} | {spread(h)} | {h['median'] / b['median']:.2f}x |")
    update_doc_section("revisions", "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
