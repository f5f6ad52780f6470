"""The demo pair on a CUDA GPU: plain decoding against speculation, greedy outputs compared.

    python benchmarks/gpu.py [--device cuda] [--repeats 3] [--new-tokens 128] [--steps eager,compiled]
                             [--out benchmarks/results/gpu.json] [--render]

The shipped 23M target and 1.4M drafter (src/infer/demo_models; SmolLM2's GGUF does not travel to a GPU machine
here), float32 and bfloat16, eager and compiled (inductor's Triton kernels), one request at a time over the 8
held-out demo prompts, then all 8 at once. Variants: plain decoding, the drafter (K auto), prompt lookup; run
interleaved (A B C A B C ...; round 0 a warm-up), per variant the median round; tokens/s = generated tokens / round
time (prefill included). Greedy outputs of each speculating variant are compared with plain decoding's (identical
expected in float32; bfloat16 steps of 1 and of K + 1 tokens round differently, so they may part at near-ties).
Writes the JSON (benchmarks/results/gpu.json by default) and prints a markdown table; ``--render`` writes the
"gpu" section of docs/benchmarks.md from the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, update_doc_section  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import demo_model_paths, demo_prompts  # noqa: E402

VARIANTS = {"plain": {}, "drafter": {"draft": True}, "prompt lookup": {"proposer": "ngram"}}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(a) -> dict:
    target, drafter = demo_model_paths()
    prompts = [p["prompt"] for p in demo_prompts()[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    res = {"machine": machine(), "device": a.device, "new_tokens": a.new_tokens, "repeats": a.repeats,
           "prompts": len(prompts), "rows": []}
    for compiled in [s == "compiled" for s in a.steps.split(",")]:  # eager first: a cut-short run keeps those rows
        for dtype in ("float32", "bfloat16"):
            llms = {}
            for name, kw in VARIANTS.items():
                kw = dict(kw)
                if kw.pop("draft", False):
                    kw["draft_model"] = str(drafter)
                llms[name] = LLM(str(target), device=a.device, dtype=dtype, compile=compiled, max_batch_size=8, **kw)
            for conc in (1, 8):
                times = {n: [] for n in llms}
                outs = {}
                for rep in range(a.repeats + 1):
                    for name, llm in llms.items():
                        _sync(a.device)
                        t0 = time.perf_counter()
                        if conc == 1:
                            got = [llm.generate([p], params)[0] for p in prompts]
                        else:
                            got = llm.generate(prompts, params)
                        _sync(a.device)
                        if rep:
                            times[name].append(time.perf_counter() - t0)
                        outs[name] = got
                base = statistics.median(times["plain"])
                for name in llms:
                    o = outs[name]
                    drafted = sum(x.num_draft_tokens for x in o)
                    res["rows"].append({
                        "dtype": dtype, "compiled": compiled, "requests_at_a_time": conc, "variant": name,
                        "tokens_per_s": sum(len(x.token_ids) for x in o) / statistics.median(times[name]),
                        "over_plain": base / statistics.median(times[name]),
                        "acceptance": sum(x.num_accepted_tokens for x in o) / drafted if drafted else None,
                        "same_as_plain": [x.token_ids for x in o] == [x.token_ids for x in outs["plain"]],
                        "round_s": times[name]})
                    print(json.dumps({k: v for k, v in res["rows"][-1].items() if k != "round_s"}), flush=True)
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(res, indent=1))  # as it goes
            for llm in llms.values():
                llm.close()
    return res


def table(res: dict) -> str:
    m = res["machine"]
    lines = [f"Machine: {m.get('cuda') or res['device']} ({m['cpu']}, {m['cores']} cores), torch {m['torch']}, "
             f"{m['date']}. Models: the demo pair (23M target, 1.4M drafter), greedy, {res['new_tokens']} new tokens "
             f"(EOS ignored), {res['prompts']} held-out demo prompts one at a time and all at once, K auto; "
             f"{res['repeats']} rounds interleaved after a warm-up, per variant the median; tokens/s with prefill.",
             "",
             "| dtype | steps | requests at a time | variant | tokens/s | vs plain | acceptance | same tokens as plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['dtype']} | {'compiled' if r['compiled'] else 'eager'} | {r['requests_at_a_time']} | "
                     f"{r['variant']} | {r['tokens_per_s']:.1f} | {r['over_plain']:.2f}x | {acc} | "
                     f"{r['same_as_plain']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", default="eager,compiled", help="eager, compiled or both (comma-separated)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    p.add_argument("--render", action="store_true", help="only write the docs section from the JSON")
    a = p.parse_args()
    if a.render:
        update_doc_section("gpu", table(json.loads(a.out.read_text())))
        return
    print(table(run(a)))


if __name__ == "__main__":
    main()
