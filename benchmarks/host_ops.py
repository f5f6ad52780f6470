"""What a decode step and a speculative round spend over the vocabulary on the host: infer's kernels against the torch
rules they replace, op by op and through the engine.

    python benchmarks/host_ops.py            # the ops alone (seconds)
    python benchmarks/host_ops.py --engine   # and SmolLM2 end to end, kernels on and off in one process

Ops (SmolLM2's 49,152-token vocabulary, float32 logits, one request): the argmax of greedy decoding (1 row) and of
a greedy verify (5 and 9 rows: K = 4 and 8), ``infer::argmax`` against ATen's ``max(-1)``; the sampled verify of 4
drafts (``spec_decode.verify.verify`` at temperature 0.7, with a drafter's q and with deterministic drafts),
``infer::rejection_sample`` against the torch rule; for scale, the temperature pipeline over the 5 rows
(``logits_to_probs``) and a plain sampled step's draw. Interleaved (A B A B ...), medians in microseconds.

Engine (``--engine``): SmolLM2-135M-Instruct as ``infer chat`` runs it (bfloat16 over its Q4_1 blocks, its default
speculation), plain and speculating engines, greedy and at temperature 0.7, 8 held-out prompts x 128 tokens, the
kernels on and off alternating pass by pass in the same engines (``--passes``, the first a warm-up); decode tokens/s
(after the first token), per setting the median pass and the median of the per-pass ratios.

Writes benchmarks/results/host_ops.json and the "host-ops" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, update_doc_section, write_json  # noqa: E402

import infer.sampling as sampling  # noqa: E402
from infer import kernels  # noqa: E402
from infer.spec_decode import verify as verify_mod  # noqa: E402

V = 49152


@contextmanager
def kernels_off():
    """The torch rules in place of infer::argmax and infer::rejection_sample (module switches, restored after)."""
    saved_argmax, saved_verify = list(sampling._kernel), verify_mod._kernel_applies
    sampling._kernel[:] = [False]
    verify_mod._kernel_applies = lambda *a: False
    try:
        yield
    finally:
        sampling._kernel[:] = saved_argmax
        verify_mod._kernel_applies = saved_verify


def time_us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def ops(rounds: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    batch = sampling.SamplingBatch.from_params([sampling.SamplingParams(temperature=0.7)], V, "cpu")
    logits = {t: torch.randn(1, t, V, generator=g) * 3 for t in (1, 5, 9)}
    p = sampling.logits_to_probs(logits[5].view(5, V), batch.expand(5)).view(1, 5, V)
    q = torch.softmax(3 * torch.randn(1, 4, V, generator=g), -1)
    drafts = torch.multinomial(q[0], 1, generator=g).view(1, 4)
    gens = [torch.Generator().manual_seed(1)]
    nd = torch.tensor([4])
    cases = {
        "argmax, 1 row (a greedy decode step)": lambda: sampling.argmax(logits[1]),
        "argmax, 5 rows (a greedy verify, K = 4)": lambda: sampling.argmax(logits[5]),
        "argmax, 9 rows (a greedy verify, K = 8)": lambda: sampling.argmax(logits[9]),
        "sampled verify, K = 4, a drafter's q": lambda: verify_mod.verify(drafts, q, p, gens, [False], nd,
                                                                          diagnostics=False),
        "sampled verify, K = 4, deterministic drafts": lambda: verify_mod.verify(drafts, None, p, gens, [False], nd,
                                                                                 diagnostics=False),
    }
    reference = {
        "temperature 0.7 over 5 rows (logits_to_probs)": lambda: sampling.logits_to_probs(logits[5].view(5, V),
                                                                                           batch.expand(5)),
        "a plain sampled step's draw (logits_to_probs + sample)": lambda: sampling.sample(
            sampling.logits_to_probs(logits[1].view(1, V), batch), gens, [False]),
    }
    out = {name: {"kernel": [], "torch": []} for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            out[name]["kernel"].append(time_us(fn, reps))
            with kernels_off():
                out[name]["torch"].append(time_us(fn, reps))
    res = {name: {side: statistics.median(v) for side, v in sides.items()} for name, sides in out.items()}
    for name, fn in reference.items():
        res[name] = {"kernel": statistics.median(time_us(fn, reps) for _ in range(rounds)), "torch": None}
    return res


def engine(passes: int, new_tokens: int) -> dict:
    from infer import LLM, SamplingParams
    from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation
    from infer.drafters import eval_prompts

    S = {**REAL_MODEL_SETTINGS, "compile_in_background": False}
    llms = {"plain": LLM(real_model_path(), max_batch_size=1, **S),
            "defaults": LLM(real_model_path(), max_batch_size=1, **S, **real_model_speculation())}
    for llm in llms.values():
        llm.engine.wait_until_ready()
    tok = llms["plain"].tokenizer
    held = eval_prompts()
    prompts = [p["prompt"] for p in held["chat"][:4]] + [p["prompt"] for p in held["code"][:4]]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    speeds: dict[str, list[float]] = {}
    for rep in range(passes + 1):
        for temp in (0.0, 0.7):
            params = SamplingParams(temperature=temp, max_tokens=new_tokens, ignore_eos=True, seed=rep)
            for on in ((True, False) if rep % 2 else (False, True)):
                for name, llm in llms.items():
                    with (kernels_off() if not on else _nothing()):
                        outs = [llm.generate([x], params)[0] for x in ids]
                    decode_s = sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outs)
                    if rep:
                        key = f"{name}, T={temp}, {'kernels' if on else 'torch'}"
                        speeds.setdefault(key, []).append(sum(len(o.token_ids) - 1 for o in outs) / decode_s)
    for llm in llms.values():
        llm.close()
    res = {}
    for name in llms:
        for temp in (0.0, 0.7):
            on, off = speeds[f"{name}, T={temp}, kernels"], speeds[f"{name}, T={temp}, torch"]
            res[f"{name}, T={temp}"] = {"kernels": statistics.median(on), "torch": statistics.median(off),
                                        "ratio": statistics.median(a / b for a, b in zip(on, off)),
                                        "ratios": [a / b for a, b in zip(on, off)]}
    return {"prompts": len(ids), "new_tokens": new_tokens, "passes": passes, "rows": res}


@contextmanager
def _nothing():
    yield


def render(res: dict) -> None:
    m = res["machine"]
    lines = [f"`python benchmarks/host_ops.py{' --engine' if 'engine' in res else ''}` ({m['cpu']}, {m['cores']} cores, "
             f"torch {m['torch']}, {m['date']}). Ops over SmolLM2's {V:,}-token vocabulary, float32, one request; "
             "interleaved, medians (us).", "",
             "| op | infer's kernel (us) | torch rule (us) | saved |", "|---|---|---|---|"]
    for name, r in res["ops"].items():
        if r["torch"] is None:
            lines.append(f"| {name} (for scale) | {r['kernel']:.0f} | - | - |")
        else:
            lines.append(f"| {name} | {r['kernel']:.0f} | {r['torch']:.0f} | {r['torch'] - r['kernel']:.0f} us "
                         f"({r['torch'] / r['kernel']:.1f}x) |")
    if "engine" in res:
        e = res["engine"]
        lines += ["", f"Through the engine: SmolLM2 as `infer chat` runs it, {e['prompts']} held-out prompts x "
                  f"{e['new_tokens']} tokens, one request at a time, kernels on and off alternating over {e['passes']} "
                  "recorded passes; decode tokens/s (median pass) and the median of the per-pass ratios. A plain "
                  "engine at T=0.7 draws through neither kernel (its row is this run's noise).", "",
                  "| engine, temperature | kernels tok/s | torch rules tok/s | kernels / torch (per pass) |",
                  "|---|---|---|---|"]
        for name, r in e["rows"].items():
            lines.append(f"| {name} | {r['kernels']:.1f} | {r['torch']:.1f} | {r['ratio']:.3f}x "
                         f"({', '.join(f'{x:.2f}' for x in r['ratios'])}) |")
    update_doc_section("host-ops", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the op timings")
    ap.add_argument("--reps", type=int, default=200, help="calls a timing (its median is kept)")
    ap.add_argument("--engine", action="store_true", help="also time SmolLM2 end to end, kernels on and off")
    ap.add_argument("--passes", type=int, default=6, help="recorded engine passes per side")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--render", action="store_true", help="only rewrite the docs table from the last results")
    a = ap.parse_args()
    if a.render:
        return render(json.loads((RESULTS / "host_ops.json").read_text()))
    if not kernels.available():
        ap.error("infer's CPU kernels could not be built here: nothing to compare")
    res = {"machine": machine(), "ops": ops(a.rounds, a.reps)}
    if a.engine:
        res["engine"] = engine(a.passes, a.new_tokens)
    write_json("host_ops", res)
    render(res)
    for name, r in res["ops"].items():
        print(name, r)
    for name, r in res.get("engine", {}).get("rows", {}).items():
        print(name, {k: round(v, 3) for k, v in r.items() if k != "ratios"})


if __name__ == "__main__":
    main()
