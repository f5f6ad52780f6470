"""The CPU kernels' cost vs activation rows: AVX2 and AVX-512 builds, int8 weight-only and llama.cpp's Q8_0 / Q4_0 /
Q4_1 blocks with int8 activations (issues 17, 32).

    python benchmarks/kernel_rows.py [--rounds 3] [--repeats 25]

One model's worth of products with SmolLM2-135M's shapes (int8 weight-only on infer::linear; Q8_0, Q4_0, Q4_1
weights x int8 activations on infer::qlinear, the head Q8_0 for the 4-bit ones as quantize_model keeps it) (per layer qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, x30, and the 49152x576 head), bfloat16 activations of M = 1, 2, 3, 4, 5, 8, 16 rows, 2 threads. Each
build runs in a process of its own (INFER_CPU_AVX512=0 / 1: the flags differ, so the builds are cached apart),
alternating, --rounds times; per M the best of --repeats per process, then the best over rounds (a shared machine
only ever slows a run down). Writes benchmarks/results/kernel_rows.json and the "kernel_rows" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, update_doc_section, write_json  # noqa: E402

ROWS = (1, 2, 3, 4, 5, 8, 16, 32, 128)  # decode, verifies, prompts
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


KERNELS = ("int8", "q8_0", "q4_0", "q4_1")  # weight-only int8 (infer::linear) / blocks x int8 activations (qlinear)
BUILDS = (("avx2", "0"), ("avx512", "1"))
# the AVX-512 build's qlinear with its 16-lane pairs of groups off (infer::qlinear_pairs, the same bits): its 8-lane
# tiles alone, what it ran before them, measured in the same process, each repeat alternating
EIGHT_LANE = " 8-lane"


def measure(repeats: int) -> dict[str, dict[int, float]]:
    """Milliseconds per model's worth of products, per kernel and M (this process's build)."""
    import time

    import torch

    from infer import kernels
    from infer.model.quant import BLOCK_FORMATS, pack_blocks, quantize_blocks

    if not kernels.available():
        raise SystemExit("infer's CPU kernels are not available here")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES]
    calls = {"int8": [(torch.ops.infer.linear, (w.div(w.abs().amax(1, keepdim=True) / 127).round().to(torch.int8),
                                                 w.abs().amax(1) / 127)) for w in dense]}
    for fmt in KERNELS[1:]:
        fmts = [fmt] * (len(dense) - 1) + ["q8_0"]  # the head stays 8-bit
        calls[fmt] = [(torch.ops.infer.qlinear, (pack_blocks(quantize_blocks(w, f), f), BLOCK_FORMATS[f][0], w.shape[0]))
                      for w, f in zip(dense, fmts)]
    pairs = torch.ops.infer.qlinear_pairs(True)  # whether this build has them
    out = {}
    for kernel in KERNELS:
        variants = [kernel] + ([kernel + EIGHT_LANE] if pairs and kernel != "int8" else [])
        for v in variants:
            out[v] = {}
        for m in ROWS:
            xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in SHAPES]
            best = dict.fromkeys(variants, float("inf"))
            for _ in range(repeats):
                for v in variants:
                    torch.ops.infer.qlinear_pairs(v == kernel)
                    t0 = time.perf_counter()
                    for (op, args), x in zip(calls[kernel], xs):
                        op(x, *args)
                    best[v] = min(best[v], time.perf_counter() - t0)
            for v in variants:
                out[v][m] = best[v] * 1e3
    torch.ops.infer.qlinear_pairs(True)
    return out


WHOLE_MODEL = ("int8", "q8_0", "q4_1")  # the variants whose whole-model verify cost is reported
WIDTHS = (1, 2, 3, 4, 5, 6, 8)


def whole_model() -> dict[str, dict]:
    """The engine's own cost model on SmolLM2 with `infer chat`'s speculation (the EAGLE head + prompt lookup), per
    quantization: a verify of T tokens in decode steps, v(T) = verify_cost(1, T) / verify_cost(1, 1) (profiled at
    start-up at a few widths, interpolated between), and the drafter's c."""
    import torch

    from infer import LLM
    from infer.demo import real_model_path, real_model_speculation

    torch.set_num_threads(2)
    out = {}
    for q in WHOLE_MODEL:
        llm = LLM(real_model_path(), dtype="bfloat16", quantization=q, max_batch_size=1, compile=True,
                  compile_in_background=False, **real_model_speculation())
        costs = llm.engine.decoder.spec_length.costs
        base = costs.verify_cost(1, 1)
        out[q] = {"decode_ms": base * 1e3, "v": {t: costs.verify_cost(1, t) / base for t in WIDTHS},
                  "c": costs.draft_cost(1) / base}
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.repeats)))
        return
    best: dict[str, dict] = {}
    for _ in range(a.rounds):
        for build, flag in BUILDS:
            run = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(a.repeats)], check=True,
                                 capture_output=True, text=True, env={**os.environ, "INFER_CPU_AVX512": flag})
            for kernel, per_m in json.loads(run.stdout.strip().splitlines()[-1]).items():
                for m, ms in per_m.items():
                    col = best.setdefault(f"{build} {kernel}", {})
                    col[int(m)] = min(col.get(int(m), float("inf")), ms)
    data = {"machine": machine(), "shapes": "SmolLM2-135M (30 layers + head)", "activations": "bfloat16 in",
            "kernels": {"int8": "infer::linear, int8 weights (one scale per row), float32 products",
                        **{f: f"infer::qlinear, {f.upper()} weights (head Q8_0) x int8 activations in blocks of 32, "
                              "integer dot products" for f in KERNELS[1:]}},
            "threads": 2, "rounds": a.rounds, "repeats": a.repeats, "ms": best, "whole_model": whole_model()}
    write_json("kernel_rows", data)
    cols = list(best)
    lines = ["## The kernels' cost vs activation rows: AVX2 and AVX-512 builds, int8, Q8_0, Q4_0, Q4_1 (issues 17, 32)", "",
             f"`benchmarks/kernel_rows.py`: {data['machine']['cpu']}, 2 threads. One model's worth of products with "
             "SmolLM2-135M's shapes, M activation rows (decode: 1; a verify of K drafts: K+1; a token tree of N "
             "nodes: N+1). int8: weight-only (`infer::linear`, float32 arithmetic); q8_0 / q4_0 / q4_1: llama.cpp's "
             "blocks (the head Q8_0) x int8 activations in blocks of 32 (`infer::qlinear`, integer dot products: "
             "vpdpbusd where the AVX-512 build has VNNI, on 256-bit registers for 8 weight rows at a time, and since "
             "2026-11-27 on 512-bit ones for 16 where a call has several activation rows; '8-lane' columns: the same "
             "build and process with those off, alternating with them repeat by repeat; vpmaddubsw in the AVX2 "
             f"build). M = 32 and 128: prompts. Best of {a.repeats} x {a.rounds} alternating "
             "processes per build; ms per model, and in brackets the cost relative to M = 1.", "",
             "| M | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for m in ROWS:
        lines.append(f"| {m} | " + " | ".join(f"{best[c][m]:.2f} ({best[c][m] / best[c][1]:.2f})" for c in cols)
                     + " |")
    wm = data["whole_model"]
    lines += ["", "The whole model (AVX-512 build): the engine's cost model on SmolLM2 with `infer chat`'s speculation "
              "(bfloat16 around the products), a verify of T tokens in decode steps as profiled at start-up (a few "
              "widths measured, the rest interpolated), the drafter's cost c, and the decode step itself.", "",
              "| quantization | decode ms | " + " | ".join(f"v(T={t})" for t in WIDTHS) + " | c |",
              "|---|---|" + "---|" * len(WIDTHS) + "---|"]
    for q, r in wm.items():
        lines.append(f"| {q} | {r['decode_ms']:.2f} | " + " | ".join(f"{r['v'][t]:.2f}" for t in WIDTHS)
                     + f" | {r['c']:.2f} |")
    update_doc_section("kernel_rows", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
