"""infer::linear's cost vs activation rows, AVX2 build against AVX-512 build (issue 17's blocker: the verify).

    python benchmarks/kernel_rows.py [--rounds 3] [--repeats 25]

One model's worth of int8 products with SmolLM2-135M's shapes (per layer qkv 960x576, o 576x576, gate_up 3072x576,
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

ROWS = (1, 2, 3, 4, 5, 8, 16)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def measure(repeats: int) -> dict[int, float]:
    """Milliseconds per model's worth of products, per M (this process's build)."""
    import time

    import torch

    from infer import kernels

    if not kernels.available():
        raise SystemExit("infer's CPU kernels are not available here")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) / 100)
          for n, k in SHAPES]
    out = {}
    for m in ROWS:
        xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in SHAPES]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for (w, s), x in zip(ws, xs):
                torch.ops.infer.linear(x, w, s)
            best = min(best, time.perf_counter() - t0)
        out[m] = best * 1e3
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
    best = {"avx2": {}, "avx512": {}}
    for _ in range(a.rounds):
        for name, flag in (("avx2", "0"), ("avx512", "1")):
            run = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(a.repeats)], check=True,
                                 capture_output=True, text=True, env={**os.environ, "INFER_CPU_AVX512": flag})
            for m, ms in json.loads(run.stdout.strip().splitlines()[-1]).items():
                best[name][int(m)] = min(best[name].get(int(m), float("inf")), ms)
    data = {"machine": machine(), "shapes": "SmolLM2-135M int8 (30 layers + head)", "activations": "bfloat16",
            "threads": 2, "rounds": a.rounds, "repeats": a.repeats, "ms": best}
    write_json("kernel_rows", data)
    lines = ["## infer::linear vs activation rows: AVX2 and AVX-512 builds (issue 17)", "",
             f"`benchmarks/kernel_rows.py`: {data['machine']['cpu']}, 2 threads. One model's worth of int8 products "
             "with SmolLM2-135M's shapes, bfloat16 activations of M rows (decode: 1; a verify of K drafts: K+1; a "
             f"token tree of N nodes: N+1); best of {a.repeats} x {a.rounds} alternating processes per build.", "",
             "| M | AVX2 ms | AVX2 / M=1 | AVX-512 ms | AVX-512 / M=1 | AVX-512 speedup |", "|---|---|---|---|---|---|"]
    for m in ROWS:
        a2, a5 = best["avx2"][m], best["avx512"][m]
        lines.append(f"| {m} | {a2:.2f} | {a2 / best['avx2'][1]:.2f} | {a5:.2f} | {a5 / best['avx512'][1]:.2f} | "
                     f"{a2 / a5:.2f}x |")
    update_doc_section("kernel_rows", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
