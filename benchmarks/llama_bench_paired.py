"""infer's plain decoding and its defaults against llama.cpp's fastest plain figure (llama-bench tg), interleaved.

    python benchmarks/llama_bench_paired.py --llama-dir <llama.cpp build/bin> [--rounds 3] [--prompts 4] [--tag xeon]

`benchmarks/drafters.py` runs llama-bench once, after all of infer's variants; on a shared host whose speed drifts
over a run, that ratio carries the drift. Here one process alternates, round by round: infer plain decoding and
infer's defaults (SmolLM2 as `infer chat` runs it: bfloat16 over its Q4_1 blocks, the suffix tree beside the EAGLE-3
head, auto K) over held-out prompts (greedy, 128 tokens; decode tok/s = tokens after the first over the time after
it, summed over the prompts; the suffix tree emptied before each), and `llama-bench -p 0 -n 128` on the same GGUF (its own repetitions, averaged). Per
side the best round (a shared machine only ever slows a run down) and the median. Writes
benchmarks/results/llama_bench_paired[-tag].json and the "llama-bench-paired[-tag]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp as lc  # noqa: E402
from common import machine, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402


def decode_speed(llm: LLM, prompts: list[str]) -> float:
    toks = secs = 0.0
    for p in prompts:
        # a proposer that learns across requests (the defaults' suffix tree) meets every prompt unseen, as in
        # benchmarks/drafters.py: the rounds repeat the prompts
        decoder = llm.engine.decoder
        if decoder is not None:
            getattr(decoder.proposer, "clear", lambda: None)()
        out = llm.chat([{"role": "user", "content": p}], SamplingParams(max_tokens=128, temperature=0))
        m = out.metrics
        toks += len(out.token_ids) - 1
        secs += m["finish_time"] - m["first_token_time"]
    return toks / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-dir", type=Path, required=True, help="llama.cpp's build/bin (benchmarks/llama_cpp.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    ep = eval_prompts()
    prompts = [p["prompt"] for kind in ("chat", "code") for p in ep[kind][:a.prompts]]
    path = real_model_path()
    llms = {"ours plain": LLM(path, max_batch_size=1, **REAL_MODEL_SETTINGS),
            "ours defaults": LLM(path, max_batch_size=1, **REAL_MODEL_SETTINGS, **real_model_speculation())}
    for llm in llms.values():
        llm.engine.wait_until_ready()
        decode_speed(llm, prompts[:1])  # one warm request each
    speed = {k: [] for k in (*llms, "llama-bench tg")}
    for r in range(a.rounds):
        for name, llm in llms.items():
            speed[name].append(decode_speed(llm, prompts))
        speed["llama-bench tg"].append(lc.bench_tg(a.llama_dir, path, 128, torch.get_num_threads()))
        print(r, {k: round(v[-1], 1) for k, v in speed.items()}, file=sys.stderr)
    data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "prompts": len(prompts),
            "llama_cpp": lc.build_commit(a.llama_dir, path), "speed": speed}
    best = {k: max(v) for k, v in speed.items()}
    med = {k: statistics.median(v) for k, v in speed.items()}
    ll = "llama-bench tg"
    md = [f"`python benchmarks/llama_bench_paired.py` ({data['machine'].get('cpu', '?')}, "
          f"{data['machine'].get('torch_threads', '?')} threads, {data['date']}): SmolLM2-135M-Instruct Q4_1, "
          f"{len(prompts)} held-out prompts x 128 tokens greedy per round, {a.rounds} rounds alternating infer plain, "
          f"infer defaults, llama-bench (llama.cpp {data['llama_cpp']}). Decode tok/s.", "",
          "| | best round | median | best / llama-bench best | median / llama-bench median |", "|---|---|---|---|---|"]
    for k in speed:
        md.append(f"| {k} | {best[k]:.1f} | {med[k]:.1f} | {best[k] / best[ll]:.2f}x | {med[k] / med[ll]:.2f}x |")
    name = "llama_bench_paired" + (f"-{a.tag}" if a.tag else "")
    write_json(name, data)
    update_doc_section(name.replace("_", "-"), f"## infer against llama-bench, interleaved: {name}\n\n" + "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
