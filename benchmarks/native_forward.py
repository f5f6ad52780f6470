"""A lone row's step as one C++ call (LlamaForCausalLM.native) against the compiled graphs it replaces (issue 33).

    python benchmarks/native_forward.py [--prompts 12] [--temperatures 0 0.7] [--tag xeon]

Four engines of SmolLM2 as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, one request) in one process:
plain decoding and the defaults (the suffix tree's copies beside the EAGLE-3 head, auto K), each "after" (the
one-call forward, graphs compiled with eager's casts) and "before" (every step through graphs compiled with
inductor's fast defaults: the revision before it). Held-out prompts, chat and code, each once per engine (the
defaults' suffix tree would copy a repeated prompt's answer), the engines in rotating order prompt by prompt, after
one warm-up request each. Per engine the decode speed (tokens after the first over the time after it): median and
quartiles, and the ratios in pairs (prompt by prompt). Greedy: whether each pair of engines wrote the same tokens
(plain and the defaults must, on either side; before and after need not: their numerics differ). Writes
benchmarks/results/native_forward[-tag].json and the "native-forward[-tag]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, quartiles, spread, update_doc_section, write_json  # noqa: E402

import infer.model.compile as compile_mod  # noqa: E402
from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402

ENGINES = {  # name: (one-call forward, the defaults' speculation, graphs compiled with inductor's fast defaults)
    "plain after": (True, False, False), "plain before": (False, False, True),
    "defaults after": (True, True, False), "defaults before": (False, True, True)}
PAIRS = [("plain after", "plain before"), ("defaults after", "defaults before"), ("defaults after", "plain after"),
         ("defaults before", "plain before")]


def _engine(native: bool, spec: bool, fast: bool) -> LLM:
    opts = compile_mod.CPU_INDUCTOR_OPTIONS
    saved = opts["emulate_precision_casts"]
    opts["emulate_precision_casts"] = not fast  # read when the model's graphs are set up (compile_model)
    try:
        llm = LLM(real_model_path(), max_batch_size=1, **REAL_MODEL_SETTINGS,
                  **(real_model_speculation() if spec else {}))
        llm.engine.wait_until_ready()
    finally:
        opts["emulate_precision_casts"] = saved
    llm.engine.model.native = native
    return llm


def run(prompts: list[str], temperature: float) -> dict:
    llms = {name: _engine(*how) for name, how in ENGINES.items()}
    for llm in llms.values():
        llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=16, temperature=0))
    speed = {name: [] for name in ENGINES}
    tokens = {name: [] for name in ENGINES}
    order = list(ENGINES)
    for i, prompt in enumerate(prompts):
        for name in order[i % 4:] + order[:i % 4]:
            out = llms[name].chat([{"role": "user", "content": prompt}],
                                  SamplingParams(max_tokens=128, temperature=temperature, seed=i))
            m = out.metrics
            speed[name].append((len(out.token_ids) - 1) / (m["finish_time"] - m["first_token_time"]))
            tokens[name].append(out.token_ids)
    res = {"temperature": temperature, "speed": {k: quartiles(v) for k, v in speed.items()},
           "pairs": {f"{a} / {b}": statistics.median([x / y for x, y in zip(speed[a], speed[b])])
                     for a, b in PAIRS}, "raw": speed}
    if temperature == 0:
        res["same tokens"] = {f"{a} / {b}": tokens[a] == tokens[b] for a, b in PAIRS}
    return res


def render(data: dict) -> str:
    m = data["machine"]
    lines = [f"`python benchmarks/native_forward.py` ({m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, "
             f"{data['date']}): SmolLM2-135M-Instruct, bfloat16 over its Q4_1 blocks, one request, "
             f"{data['prompts']} held-out prompts (half chat, half code) x 128 tokens, each once per engine, the "
             "engines in rotating order. Decode tok/s, median (quartiles); pairs: prompt by prompt.", "",
             "| temperature | plain after | plain before | defaults after | defaults before | plain after/before "
             "| defaults after/before | defaults/plain after | defaults/plain before |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        s, p = r["speed"], r["pairs"]
        lines.append(f"| {r['temperature']} | " + " | ".join(spread(s[k]) for k in ENGINES) + " | " +
                     " | ".join(f"{p[f'{a} / {b}']:.3f}" for a, b in PAIRS) + " |")
    same = [r["same tokens"] for r in data["runs"] if "same tokens" in r]
    if same:
        lines += ["", "Greedy, the same tokens: " + ", ".join(f"{k} {v}" for k, v in same[0].items()) + "."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--tag", default="", help="a suffix for the results and the section (a host)")
    a = ap.parse_args()
    ep = eval_prompts()
    prompts = [p["prompt"] for kind in ("chat", "code") for p in ep[kind][:a.prompts]]
    data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "prompts": len(prompts),
            "runs": [run(prompts, t) for t in a.temperatures]}
    name = "native_forward" + (f"-{a.tag}" if a.tag else "")
    write_json(name, data)
    update_doc_section(name.replace("_", "-"), f"## The one-call forward against compiled graphs: {name}\n\n" +
                       render(data))
    print(render(data))


if __name__ == "__main__":
    main()
