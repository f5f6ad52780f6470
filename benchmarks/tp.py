"""Tensor parallelism on this machine, and where the drafter runs (issue 19).

    python benchmarks/tp.py [--repeats 3] [--prompts 3] [--new-tokens 64]

SmolLM2-135M-Instruct (GGUF, float32, eager: tensor parallelism shards unquantized weights and runs uncompiled) with
its shipped LM drafter, greedy, K = 3 pinned (the SPMD side needs it), one request at a time over the held-out
prompts of src/infer/drafters/eval_prompts.json (chat template applied). Three sides, each in processes of its own,
run interleaved (A B C A B C ...; round 0 a warm-up, not recorded); a side waits idle while another is timed:

  tp1       one process, 2 threads: the reference
  executor  LLM(tensor_parallel_size=2): rank 0 runs the engine and drafts alone (the drafter on rank 0, TP 1);
            the worker repeats rank 0's target calls (engine/tp_executor.py); 1 thread a rank
  spmd      two ranks each running the whole engine on the same requests (model/tp.py run SPMD): the drafter
            replicated on every rank, no control messages; 1 thread a rank

Per side: plain decoding and speculative decoding. Every side's tokens are asserted equal to tp1's. Writes
benchmarks/results/tp.json, the "tp" section of docs/benchmarks.md and docs/tp.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, free_port, machine, update_doc_section, write_json  # noqa: E402

K = 3
SIDES = ("tp1", "executor", "spmd")
VARIANTS = ("plain", "speculative")


def _engine(side: str, rank: int, path: str, drafter: str, init: str | None):
    """The engine a side's rank-0 process (or an SPMD rank) drives."""
    from infer.engine import Engine, EngineConfig

    cfg = dict(model=path, draft_model=drafter, spec_length=K, compile=False, dtype="float32", max_batch_size=1)
    if side == "tp1":
        torch.set_num_threads(2)
        return Engine(EngineConfig(**cfg))
    if side == "executor":
        return Engine(EngineConfig(**cfg, tensor_parallel_size=2))
    import torch.distributed as dist

    from infer.model.loader import load_model
    from infer.model.tp import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    return Engine(EngineConfig(**cfg), model=shard_model(load_model(path)), draft_model=load_model(drafter))


def _all_reduce_latency(hidden: int, n: int = 500) -> float:
    """Seconds per all-reduce of one decode token's hidden state ([1, 1, H] float32), the collective a layer runs
    twice: the best of 3 runs of n."""
    import torch.distributed as dist

    x, best = torch.randn(1, 1, hidden), float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _side(side: str, rank: int, path: str, drafter: str, init: str | None, prompts, new_tokens: int, cmds, results):
    from infer.sampling import SamplingParams

    eng = _engine(side, rank, path, drafter, init)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    results.put(("ready", side, rank))
    while True:
        variant = cmds.get()
        if variant is None:
            break
        if variant == "all_reduce":
            latency = _all_reduce_latency(eng.model.config.hidden_size)
            if rank == 0:
                results.put(latency)
            continue
        t0 = time.perf_counter()
        out = [eng.run([eng.add_request(p, greedy, speculate=variant == "speculative")])[0].output_ids
               for p in prompts]
        took = time.perf_counter() - t0
        if rank == 0:
            results.put((side, variant, took, out))
    eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()

    from infer.demo import drafter_paths, real_model_path
    from infer.drafters import eval_prompts
    from infer.tokenizer import Tokenizer

    path, drafter = str(real_model_path()), str(drafter_paths()["draft_model"])
    tok = Tokenizer(path)
    held_out = eval_prompts()  # chat and code prompts, alternating
    chosen = (held_out["chat"][:a.prompts - a.prompts // 2] + held_out["code"][:a.prompts // 2])
    prompts = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in chosen]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sides, procs = {}, []
    init = f"tcp://127.0.0.1:{free_port()}"
    for side in SIDES:
        ranks = (0, 1) if side == "spmd" else (0,)
        sides[side] = [ctx.Queue() for _ in ranks]
        for r, q in zip(ranks, sides[side]):
            procs.append(ctx.Process(target=_side, args=(side, r, path, drafter, init if side == "spmd" else None,
                                                          prompts, a.new_tokens, q, results)))
            procs[-1].start()
    for _ in procs:
        assert results.get(timeout=900)[0] == "ready"
    for q in sides["spmd"]:  # every side loaded and idle now
        q.put("all_reduce")
    all_reduce_s = results.get(timeout=300)

    times = {(s, v): [] for s in SIDES for v in VARIANTS}
    tokens = {}
    for rnd in range(a.repeats + 1):
        for s in SIDES:
            for v in VARIANTS:
                for q in sides[s]:
                    q.put(v)
                side, variant, took, out = results.get(timeout=900)
                tokens[(side, variant)] = out
                if rnd:
                    times[(side, variant)].append(took)
                print(f"round {rnd} {side:9s} {variant:12s} {took:6.2f} s", flush=True)
    for qs in sides.values():
        for q in qs:
            q.put(None)
    for p in procs:
        p.join(timeout=60)

    ref = tokens[("tp1", "plain")]
    same = {f"{s}/{v}": tokens[(s, v)] == ref for s in SIDES for v in VARIANTS}
    n_tokens = a.prompts * a.new_tokens
    rows = {}
    for (s, v), ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        rows[f"{s}/{v}"] = {"seconds": ts, "median_s": statistics.median(ts), "q1_s": q[0], "q3_s": q[2],
                            "tokens_per_s": n_tokens / statistics.median(ts)}
    base = rows["tp1/plain"]["tokens_per_s"]
    for r in rows.values():
        r["vs_tp1_plain"] = r["tokens_per_s"] / base
    data = {"machine": machine(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32), eager",
            "drafter": "shipped LM drafter (smollm2-lm)", "K": K, "prompts": a.prompts, "new_tokens": a.new_tokens,
            "repeats": a.repeats, "greedy_tokens_equal_tp1": same, "all_reduce_hidden_s": all_reduce_s,
            "results": rows}
    write_json("tp", data)

    names = {"tp1": "TP 1 (2 threads)", "executor": "TP 2, executor: drafter on rank 0",
             "spmd": "TP 2, SPMD: drafter on every rank"}
    lines = ["## Tensor parallelism and drafter placement (issue 19)", "",
             f"`benchmarks/tp.py`: {data['machine']['cpu']}, {data['machine']['cores']} vCPU, torch "
             f"{data['machine']['torch']}. SmolLM2-135M-Instruct float32 eager (tensor parallelism shards unquantized "
             f"weights, uncompiled), its shipped LM drafter, greedy, K = {K}, {a.prompts} held-out prompts x "
             f"{a.new_tokens} tokens, one request at a time; {a.repeats} interleaved rounds after a warm-up, median "
             "(quartiles) per side. Both TP 2 sides run 2 processes of 1 thread each on the same 2 cores.", "",
             "| side | decoding | tokens/s | median s (q1-q3) | vs TP 1 plain | tokens = TP 1 |",
             "|---|---|---|---|---|---|"]
    for s in SIDES:
        for v in VARIANTS:
            r = rows[f"{s}/{v}"]
            lines.append(f"| {names[s]} | {v} | {r['tokens_per_s']:.1f} | {r['median_s']:.2f} "
                         f"({r['q1_s']:.2f}-{r['q3_s']:.2f}) | {r['vs_tp1_plain']:.2f}x | "
                         f"{'yes' if same[f'{s}/{v}'] else 'NO'} |")
    ex, sp = rows["executor/speculative"]["tokens_per_s"], rows["spmd/speculative"]["tokens_per_s"]
    per_step = 2 * 30 + 2  # two all-reduces a layer (SmolLM2: 30 layers), the embedding's and the head's gather
    lines += ["", f"Drafter placement, speculative: on rank 0 (executor) {ex:.1f} tokens/s vs replicated on every rank "
                  f"(SPMD) {sp:.1f} ({ex / sp:.2f}x).",
              "", f"One gloo all-reduce of a decode token's hidden state ([1, 1, 576] float32) between the two processes "
                  f"takes {all_reduce_s * 1e3:.2f} ms here (best of 3 x 500); a decode step runs {per_step} "
                  f"collectives: ~{per_step * all_reduce_s * 1e3:.0f} ms of a TP 2 step "
                  f"({1e3 / rows['tp1/plain']['tokens_per_s']:.0f} ms a token for TP 1, "
                  f"{1e3 / rows['executor/plain']['tokens_per_s']:.0f} ms for the executor)."]
    update_doc_section("tp", "\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels, vals = [], []
    for s in SIDES:
        for v in VARIANTS:
            labels.append(f"{s}\n{v}")
            vals.append(rows[f"{s}/{v}"]["tokens_per_s"])
    ax.bar(range(len(vals)), vals, color=["#888", "#3a7"] * len(SIDES))
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("SmolLM2 float32 eager, 2 vCPU: TP 1 vs TP 2 (executor, SPMD)", fontsize=9)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "tp.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
