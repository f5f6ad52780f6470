"""Where a draft step's cost goes on SmolLM2 (issue 33's c and v, measured apart from any round).

For each head drafter (EAGLE, EAGLE-3) and draft quantization, in one process per setting, interleaved
(decode, draft step after it, draft step after that one, verify of K+1 = 5, ...):

- decode: one target token (bfloat16, the GGUF's Q4_1 blocks, compiled) and its logits, synced;
- verify5: five target tokens and their logits (a K = 4 round's verify);
- draft cold: one draft step (the head's layer and its draft-vocabulary scores, argmax synced) right after a target
  step, which has streamed ~80 MB of weights through the caches: the first draft step of a round;
- draft warm: the same step right after another draft step: a round's later draft steps, one at a time (as
  sampled rounds run them);
- chain of 3: a round's three later steps as one compiled chain (EagleHead.draft_chain: the head's layer, the
  draft-vocabulary scores and the argmax, or a draw at temperature 0.7, fed to the next step, one graph), synced;
  reported per step.

c = draft step / decode step (c chain: a chain step) and v = verify5 / decode step, each from the medians (quartiles
in the JSON). A profile of warm draft steps (torch.profiler, top ops by self time) says what the step is made of.
Writes benchmarks/results/draft_step.json and the "draft-step" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import interleaved, machine, update_doc_section, write_json
from infer import LLM
from infer.demo import REAL_MODEL_SETTINGS, real_model_path
from infer.drafters import drafter_paths
from infer.proposers.draft_vocab import PromptVocabs

N_CTX = 32  # tokens of context in the scratch slots
CHAIN = 3  # the later steps of a K = 4 round


def measure(kind: str, quantization: str, repeats: int, profile_steps: int) -> dict:
    llm = LLM(str(real_model_path()), **REAL_MODEL_SETTINGS, draft_model=str(drafter_paths()[kind]),
              proposer="draft", max_batch_size=1, compile_in_background=False, draft_quantization=quantization)
    dec = llm.engine.decoder
    runner, kv, drafter = dec.runner, dec.kv, dec.proposer
    slot = kv.pool.allocate(N_CTX + 8)
    dslot = kv.draft_pool.allocate(N_CTX + 8)
    with torch.inference_mode():  # as rounds and the cost model run (a grad-mode call compiles another graph)
        runner.forward(runner.model, kv.pool, [slot], [[1] * N_CTX])
        drafter.scratch_fill([dslot], N_CTX)

    @torch.inference_mode()
    def target(t: int) -> None:
        hidden = runner.forward(runner.model, kv.pool, [slot], [[1] * t])
        runner.model.compute_logits(hidden).max(-1).indices.tolist()
        kv.pool.truncate_to(slot, N_CTX)

    @torch.inference_mode()
    def draft() -> None:
        drafter.scratch_step([dslot], 1)
        kv.draft_pool.truncate_to(dslot, N_CTX)

    dev = drafter.head.device
    tok = torch.ones(1, dtype=torch.long, device=dev)
    f = torch.zeros(1, drafter.head.config.hidden_size, dtype=drafter.head.dtype, device=dev)
    vocab = PromptVocabs.widened(drafter.draft_vocab)  # as a round's (a prompt's tokens added)

    @torch.inference_mode()
    def chain(temperature: float) -> None:
        u = torch.rand(1, CHAIN, dtype=torch.float64, device=dev)
        drafter.head.draft_chain(tok, f, kv.draft_pool, kv.draft_pool.prepare_run([dslot], CHAIN, dev), vocab,
                                 torch.full((1,), temperature, device=dev), u)[0].tolist()
        kv.draft_pool.truncate_to(dslot, N_CTX)

    # in this order: "draft cold" follows a target step, "draft warm" follows "draft cold", the chains another step
    fns = {"decode": lambda: target(1), "draft cold": draft, "draft warm": draft, "chain": lambda: chain(0.0),
           "chain T=0.7": lambda: chain(0.7), "verify5": lambda: target(5)}
    interleaved(fns, 5)  # first calls: allocations, graph lookups
    times = interleaved(fns, repeats)
    ms = {k: sorted(v) for k, v in times.items()}
    stats = {k: {"median_ms": 1e3 * statistics.median(v), "q1_ms": 1e3 * v[len(v) // 4],
                 "q3_ms": 1e3 * v[(3 * len(v)) // 4], "best_ms": 1e3 * v[0]} for k, v in ms.items()}
    dec_ms = stats["decode"]["median_ms"]
    out = {"drafter": kind, "draft_quantization": quantization, "steps": stats,
           "c_cold": stats["draft cold"]["median_ms"] / dec_ms, "c_warm": stats["draft warm"]["median_ms"] / dec_ms,
           "chain_step_ms": stats["chain"]["median_ms"] / CHAIN,
           "c_chain": stats["chain"]["median_ms"] / CHAIN / dec_ms,
           "chain_t07_step_ms": stats["chain T=0.7"]["median_ms"] / CHAIN,
           "c_chain_t07": stats["chain T=0.7"]["median_ms"] / CHAIN / dec_ms,
           "v5": stats["verify5"]["median_ms"] / dec_ms,
           "head_params": sum(p.numel() for p in drafter.head.parameters())}
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(5):
            draft()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profile_steps):
                draft()
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        out["profile_warm_us"] = [{"op": e.key[:60], "us_per_step": e.self_cpu_time_total / profile_steps,
                                   "calls_per_step": e.count / profile_steps} for e in rows]
    return out


def render(results: list[dict], info: dict) -> str:
    lines = [f"`python benchmarks/draft_step.py` ({info['cpu']}, {info['cores']} cores, {info['date']}). Target: "
             "SmolLM2-135M-Instruct, bfloat16 over its GGUF Q4_1 blocks, compiled; one row, 32 tokens of context; "
             f"{info['repeats']} interleaved rounds, medians (ms). c = draft step / decode step, v = verify of 5 "
             "tokens / decode step. \"cold\": a draft step right after a target step (a round's first), \"warm\": "
             f"right after another draft step (its later ones, one at a time); \"chain step\": a round's {CHAIN} later "
             "steps as one compiled chain (EagleHead.draft_chain), per step, greedy (T=0.7: drawn at temperature "
             "0.7).", "",
             "| drafter | draft weights | decode | verify 5 | draft cold | draft warm | chain step | "
             "chain step T=0.7 | c cold | c warm | c chain | v(5) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["steps"]
        lines.append(f"| {r['drafter']} | {r['draft_quantization']} | {s['decode']['median_ms']:.2f} | "
                     f"{s['verify5']['median_ms']:.2f} | {s['draft cold']['median_ms']:.2f} | "
                     f"{s['draft warm']['median_ms']:.2f} | {r['chain_step_ms']:.2f} | {r['chain_t07_step_ms']:.2f} | "
                     f"{r['c_cold']:.3f} | "
                     f"{r['c_warm']:.3f} | {r['c_chain']:.3f} | {r['v5']:.2f} |")
    prof = [r for r in results if r.get("profile_warm_us")]
    for r in prof:
        ops = ", ".join(f"{p['op']} {p['us_per_step']:.0f}" for p in r["profile_warm_us"])
        lines += ["", f"{r['drafter']} ({r['draft_quantization']}), a warm draft step's top ops by self time "
                      f"(us a step, under the profiler): {ops}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--drafters", default="eagle,eagle3")
    ap.add_argument("--quantizations", default="q8_0,q4_0")
    ap.add_argument("--profile-steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = [measure(k, q, args.repeats, args.profile_steps)
               for k in args.drafters.split(",") for q in args.quantizations.split(",")]
    info = {**machine(), "repeats": args.repeats}
    write_json("draft_step", {"machine": info, "results": results})
    update_doc_section("draft-step", "## Where a draft step goes (issue 33)\n\n" + render(results, info))
    print(render(results, info))


if __name__ == "__main__":
    main()
