"""Time to the first token, two revisions of infer side by side: what a change did to a prompt's prefill.

SmolLM2-135M-Instruct as `infer chat` runs it (bfloat16 over its GGUF's Q4_1 blocks, one request, graphs built
before timing), no speculation: a speculating engine's first token is the same prefill (its drafter catches up in
its first round). Each revision is checked out in a git worktree of its own; a fresh process per (revision, repeat)
imports infer from it, chat-templates the held-out prompts (src/infer/drafters/eval_prompts.json, chat and code: 36
to 330 tokens), runs one untimed request, then times ``generate(max_tokens=1)`` of each prompt ``--rounds`` times.
Processes alternate (base, head, base, head, ...) so a slower stretch of the machine hits both; per prompt the median
of a side's timings, per side the sum over the prompts (the time a client waits for the first tokens of all of them)
and per length band the ratio of the sums.

    python benchmarks/prefill.py --base 4466f23 [--head HEAD] [--repeats 4] [--rounds 3] [--prompts 24]

Writes benchmarks/results/prefill.json, the "prefill" section of docs/benchmarks.md and results/prefill.png.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, update_doc_section, write_json  # noqa: E402
from revisions import remove_worktrees, revision_args, run_script, worktree  # noqa: E402

WORKER = r"""
import json, statistics, sys, time
import infer
from infer import LLM, SamplingParams
from infer.demo import REAL_MODEL_SETTINGS, real_model_path
from infer.drafters import eval_prompts
assert infer.__file__.startswith(sys.argv[1]), (infer.__file__, sys.argv[1])  # the revision under test
rounds, per_kind = int(sys.argv[2]), int(sys.argv[3])
llm = LLM(real_model_path(), **REAL_MODEL_SETTINGS, max_batch_size=1, compile_in_background=False)
ps = eval_prompts()
ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}])
       for p in ps["chat"][:per_kind] + ps["code"][:per_kind]]
sp = SamplingParams(temperature=0, max_tokens=1)
llm.generate(ids[:2], sp)  # untimed
times = [[] for _ in ids]
first = []
for r in range(rounds):
    for i, x in enumerate(ids):
        t0 = time.perf_counter()
        o = llm.generate([x], sp)[0]
        times[i].append(time.perf_counter() - t0)
        if r == 0:
            first.append(o.token_ids[0])
print("RESULT " + json.dumps({"lengths": [len(x) for x in ids], "ttft_s": [statistics.median(t) for t in times],
                              "first_tokens": first}))
"""

BANDS = ((0, 64), (64, 150), (150, 10_000))  # prompt tokens: short chat turns, longer questions, code with context


def render(res: dict) -> str:
    m, lens = res["machine"], res["lengths"]
    med = {n: [statistics.median(run[i] for run in s["runs"]) for i in range(len(lens))]
           for n, s in res["sides"].items()}
    md = [f"Time to the first token, revision {res['base']} (base) against {res['head']} (head): SmolLM2-135M-Instruct "
          f"with `infer chat`'s settings (bfloat16 over its GGUF's Q4_1 blocks), plain decoding, one request, the "
          f"{len(lens)} held-out prompts chat-templated ({min(lens)}-{max(lens)} tokens, median "
          f"{statistics.median(lens):g}), {res['rounds']} timings a prompt in each of {res['repeats']} processes per "
          f"side, processes alternating; per prompt the median over all. {m['cpu']}, {m['cores']} cores, torch "
          f"{m['torch']}, {m['date']}. `python benchmarks/prefill.py --base {res['base']}`.", "",
          "| prompt tokens | prompts | base: sum of TTFTs | head: sum of TTFTs | base / head | head ms a prompt token |",
          "|---|---|---|---|---|---|"]
    for lo, hi in BANDS + ((0, 10_000),):
        sel = [i for i, n in enumerate(lens) if lo <= n < hi]
        if not sel:
            continue
        b, h = (sum(med[n][i] for i in sel) for n in ("base", "head"))
        label = "all" if (lo, hi) == (0, 10_000) else f"{lo}-{hi - 1}" if hi < 10_000 else f">= {lo}"
        md.append(f"| {label} | {len(sel)} | {b:.3f} s | {h:.3f} s | **{b / h:.2f}x** | "
                  f"{1e3 * h / sum(lens[i] for i in sel):.2f} |")
    per_run = [f"{sum(b) / sum(h):.2f}" for b, h in zip(res["sides"]["base"]["runs"], res["sides"]["head"]["runs"])]
    same = sum(x == y for x, y in zip(res["sides"]["base"]["first_tokens"], res["sides"]["head"]["first_tokens"]))
    md += ["", f"Base / head by process pair (sums over the prompts): {', '.join(per_run)}. First tokens alike in "
           f"{same} of {len(lens)} prompts (greedy)."]
    return "\n".join(md)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = res["lengths"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for n, s in res["sides"].items():
        med = [1e3 * statistics.median(run[i] for run in s["runs"]) for i in range(len(lens))]
        ax.scatter(lens, med, s=14, label=f"{n} ({s['rev']})")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("SmolLM2-135M Q4_1/bf16, one request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "prefill.png", dpi=120)


def main() -> None:
    ap = revision_args(__doc__, repeats=4)
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts per kind (chat, code)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="infer-prefill-"))
    sides = {}
    try:
        for name, rev in (("base", a.base), ("head", a.head)):
            sha, path = worktree(rev, root)
            sides[name] = {"rev": sha, "src": path / "src", "runs": []}
        for i in range(a.repeats):
            for name, side in sides.items():
                got = run_script(WORKER, side["src"], str(a.rounds), str(a.prompts))
                side["runs"].append(got["ttft_s"])
                side["lengths"], side["first_tokens"] = got["lengths"], got["first_tokens"]
                print(f"#{i + 1} {name}: {sum(got['ttft_s']):.3f} s over {len(got['ttft_s'])} prompts", flush=True)
    finally:
        remove_worktrees(side["src"].parent for side in sides.values())
    res = {"machine": machine(), "base": sides["base"]["rev"], "head": sides["head"]["rev"],
           "model": "SmolLM2-135M-Instruct (GGUF, its own Q4_1 blocks), bfloat16", "repeats": a.repeats,
           "rounds": a.rounds, "lengths": sides["head"]["lengths"],
           "sides": {n: {"rev": s["rev"], "runs": s["runs"], "first_tokens": s["first_tokens"]}
                     for n, s in sides.items()}}
    write_json("prefill", res)
    md = render(res)
    update_doc_section("prefill", "## Time to the first token, two revisions (`benchmarks/prefill.py`)\n\n" + md
                       + "\n\n![prefill](../benchmarks/results/prefill.png)")
    plot(res)
    print(md)


if __name__ == "__main__":
    main()
