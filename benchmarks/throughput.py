"""Engine throughput on the shipped demo pair: output tokens/s vs concurrency, with and without speculation.

At concurrency C, C requests (held-out code prompts, cycled) are submitted at once and the engine runs until all
finish; throughput = generated tokens / wall time. Variants, interleaved within each repeat (medians):
  plain            continuous batching, no drafter
  spec always      SpeculativeRunner, K drafts every round whatever the batch size
  spec (default)   SpeculativeRunner with spec_max_batch_size: rounds only while the decode batch is small enough,
                   plain decode steps above it (the drafter catches up lazily; lossless either way)

    python benchmarks/throughput.py [--concurrency 1,2,4,8,16] [--new-tokens 64] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, median, update_doc_section, write_json  # noqa: E402

from infer.demo import demo_model_paths, demo_prompts  # noqa: E402
from infer.engine import Engine, EngineConfig  # noqa: E402
from infer.model import load_model  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402
from infer.tokenizer import Tokenizer  # noqa: E402


def make_engine(target, drafter, tok, dtype, spec, K, max_batch, spec_max_batch_size=None) -> Engine:
    t, d = demo_model_paths()
    cfg = EngineConfig(model=str(t), draft_model=str(d) if spec else None, spec_length=K, dtype=dtype,
                       max_batch_size=max_batch, max_seq_len=1024, block_size=16, max_num_batched_tokens=2048,
                       spec_max_batch_size=spec_max_batch_size)
    return Engine(cfg, model=target, draft_model=drafter if spec else None, tokenizer=tok)


def run_once(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, Engine]:
    t0 = time.perf_counter()
    reqs = engine.run([engine.add_request(p, params) for p in prompts])
    dt = time.perf_counter() - t0
    assert engine.free_kv_tokens() == engine.initial_free_kv_tokens
    return dt, sum(len(r.output_ids) for r in reqs), reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--spec-length", type=int, default=2)
    ap.add_argument("--spec-max-batch-size", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    t_dir, d_dir = demo_model_paths()
    dtype = getattr(torch, a.dtype)
    target, drafter = load_model(t_dir, dtype), load_model(d_dir, dtype)
    tok = Tokenizer(t_dir)
    all_prompts = [tok.encode(p["prompt"]) for p in demo_prompts()]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.new_tokens, ignore_eos=True, seed=0)
    mb = max(levels)
    engines = {
        "plain": make_engine(target, drafter, tok, a.dtype, False, a.spec_length, mb),
        "spec always": make_engine(target, drafter, tok, a.dtype, True, a.spec_length, mb),
        f"spec (<= {a.spec_max_batch_size})": make_engine(target, drafter, tok, a.dtype, True, a.spec_length, mb,
                                                        a.spec_max_batch_size),
    }
    for e in engines.values():  # warm-up
        run_once(e, all_prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    rows = []
    for c in levels:
        prompts = [all_prompts[i % len(all_prompts)] for i in range(c)]
        times = {k: [] for k in engines}
        acc = {}
        outputs = {}
        for _ in range(a.repeats):
            for name, eng in engines.items():
                before = eng.stats.num_accepted_tokens, eng.stats.num_draft_tokens
                dt, n, reqs = run_once(eng, prompts, params)
                times[name].append(n / dt)
                drafted = eng.stats.num_draft_tokens - before[1]
                acc[name] = (eng.stats.num_accepted_tokens - before[0]) / drafted if drafted else None
                outputs[name] = [r.output_ids for r in reqs]
        row = {"concurrency": c, "tok_s": {k: median(v) for k, v in times.items()}, "acceptance": acc,
               "same_output": all(v == outputs["plain"] for v in outputs.values())}
        rows.append(row)
        print(c, {k: round(v, 1) for k, v in row["tok_s"].items()}, row["same_output"], flush=True)
    result = {"machine": machine(), "models": {"target": str(t_dir), "drafter": str(d_dir)}, "dtype": a.dtype,
              "K": a.spec_length, "new_tokens": a.new_tokens, "temperature": a.temperature,
              "repeats": a.repeats, "spec_max_batch_size": a.spec_max_batch_size,
              "prompts": "held-out stdlib modules (src/infer/demo_models/prompts.json), cycled", "rows": rows}
    write_json(f"throughput_{a.dtype}", result)
    write_doc(result)
    plot(result)


def write_doc(r: dict) -> None:
    names = list(r["rows"][0]["tok_s"])
    m = r["machine"]
    lines = [f"Machine: {m['cpu']}, {m['torch_threads']} torch threads, torch {m['torch']}; {r['dtype']}; demo pair; "
             f"K={r['K']}; {r['new_tokens']} new tokens per request, temperature {r['temperature']}; "
             f"{r['repeats']} interleaved repeats, medians. Outputs identical across variants: "
             f"{all(x['same_output'] for x in r['rows'])}.", "",
             "| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " | spec always / plain | "
             f"{names[2]} / plain | acceptance |",
             "|---:|" + "---:|" * (len(names) + 3)]
    for row in r["rows"]:
        t = row["tok_s"]
        acc = row["acceptance"][names[1]]
        lines.append(f"| {row['concurrency']} | " + " | ".join(f"{t[n]:.1f}" for n in names) +
                     f" | {t[names[1]] / t['plain']:.2f}x | {t[names[2]] / t['plain']:.2f}x | "
                     f"{acc:.2f} |" if acc is not None else " | - |")
    lines += ["", f"![throughput](throughput_{r['dtype']}.png)"]
    update_doc_section(f"throughput_{r['dtype']}", "\n".join(lines))


def plot(r: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [row["concurrency"] for row in r["rows"]]
    for name in r["rows"][0]["tok_s"]:
        ax.plot(cs, [row["tok_s"][name] for row in r["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Engine throughput, demo pair, {r['dtype']}, K={r['K']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / f"throughput_{r['dtype']}.png", dpi=110)


if __name__ == "__main__":
    main()
