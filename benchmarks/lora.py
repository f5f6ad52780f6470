"""What a LoRA adapter costs a decode step (model.lora), on SmolLM2 as `infer chat` runs it.

    python benchmarks/lora.py [--prompts 4] [--ranks 8 64] [--modules 4] [--slots 2] [--slot-rank 16] [--tag zen3]

Engines in one process, SmolLM2-135M-Instruct in bfloat16 over its Q4_1 blocks, one request, plain decoding (the
adapter's cost is the target's; speculation with it verifies with the same steps): the base model, and the same with
a random PEFT adapter of each rank over all seven projections of the 30 layers (A ~ N(0, 1 / in), B ~ N(0, 0.02^2):
a text still in English). A lone request's steps are one C++ call (kernels/lm_round.cpp) that adds each product's
delta B (A x) beside the llama.cpp blocks; no graph is compiled; the first rank's engine again with every step
through the module's eager ops ("eager": what the one-call path replaces); and an engine loading ``--modules`` adapters
of the first rank that each request picks from (EngineConfig.lora_modules), asked with the first adapter ("picked":
a lone row computes its own adapter's pair of products alone) and with none ("none picked": the base model's steps
on an engine that carries adapters); and an engine with ``--slots`` slots of rank ``--slot-rank``
for adapters loaded while it runs (EngineConfig.enable_lora), one of the first rank loaded after start, asked with it
("slots, picked": its slot's max_lora_rank columns) and with none; the time a load and an unload take there
(median of 5 each). Held-out prompts, chat and code, each once per
engine, the engines in rotating order prompt by prompt, after one warm-up request each. Per engine the decode speed
(tokens after the first over the time after it): median and quartiles, and the ratio to the base in pairs (prompt
by prompt). Writes benchmarks/results/lora[-tag].json and the "lora[-tag]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, quartiles, spread, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402


def write_adapter(out: Path, llm: LLM, r: int, seed: int = 0) -> Path:
    """A random PEFT adapter of rank r on every projection of every layer of ``llm``'s model."""
    c, g = llm.model.config, torch.Generator().manual_seed(seed)
    q, kv, h, i = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, \
        c.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i)}
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for name, (n_out, n_in) in shapes.items():
            kind = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{kind}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                         "target_modules": list(shapes), "bias": "none"}))
    return out


def run(prompts: list[str], ranks: list[int], scratch: Path, modules: int, slots: int = 0, slot_rank: int = 16
        ) -> dict:
    base = LLM(real_model_path(), max_batch_size=1, compile=False, **REAL_MODEL_SETTINGS)
    llms = {"base": base}
    for r in ranks:
        llms[f"lora r={r}"] = LLM(real_model_path(), max_batch_size=1, compile=False, **REAL_MODEL_SETTINGS,
                                  lora=str(write_adapter(scratch / f"r{r}", base, r)))
    # the first rank's adapter again, its steps through the module's eager ops (what the one-call path replaces)
    eager = llms[f"lora r={ranks[0]} eager"] = LLM(real_model_path(), max_batch_size=1, compile=False,
                                                   **REAL_MODEL_SETTINGS, lora=str(scratch / f"r{ranks[0]}"))
    eager.model.native = False
    picks = {name: None for name in llms}
    if modules:
        dirs = {f"a{j}": str(write_adapter(scratch / f"m{j}", base, ranks[0], seed=j)) for j in range(modules)}
        per = LLM(real_model_path(), max_batch_size=1, compile=False, **REAL_MODEL_SETTINGS, lora_modules=dirs)
        llms[f"{modules} adapters r={ranks[0]}, picked"] = llms[f"{modules} adapters, none picked"] = per
        picks[f"{modules} adapters r={ranks[0]}, picked"] = "a0"
        picks[f"{modules} adapters, none picked"] = None
    load_ms = None
    if slots:
        dyn = LLM(real_model_path(), max_batch_size=1, compile=False, **REAL_MODEL_SETTINGS, enable_lora=True,
                  max_loras=slots, max_lora_rank=slot_rank)
        times = {"load": [], "unload": []}
        for _ in range(5):
            for what, call in (("load", lambda: dyn.engine.load_lora("a", scratch / f"r{ranks[0]}")),
                               ("unload", lambda: dyn.engine.unload_lora("a"))):
                t0 = time.perf_counter()
                call()
                times[what].append((time.perf_counter() - t0) * 1e3)
        dyn.engine.load_lora("a", scratch / f"r{ranks[0]}")
        load_ms = {k: statistics.median(v) for k, v in times.items()}
        llms[f"{slots} slots r={slot_rank}, r={ranks[0]} picked"] = llms[f"{slots} slots, none picked"] = dyn
        picks[f"{slots} slots r={slot_rank}, r={ranks[0]} picked"] = "a"
        picks[f"{slots} slots, none picked"] = None
    native = {name: llm.model.native and llm.model.runs_natively(llm.engine.kv.pool) for name, llm in llms.items()}
    for name, llm in llms.items():
        llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=16, temperature=0),
                 lora_request=picks[name])
    speed = {name: [] for name in llms}
    order = list(llms)
    for i, prompt in enumerate(prompts):
        for name in order[i % len(order):] + order[:i % len(order)]:
            out = llms[name].chat([{"role": "user", "content": prompt}],
                                  SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
                                  lora_request=picks[name])
            m = out.metrics
            speed[name].append((len(out.token_ids) - 1) / (m["finish_time"] - m["first_token_time"]))
    return {"speed": {k: quartiles(v) for k, v in speed.items()},
            "over base": {k: statistics.median([x / y for x, y in zip(speed[k], speed["base"])])
                          for k in llms if k != "base"},
            "one call": native, "raw": speed, "load ms": load_ms}


def render(data: dict) -> str:
    m, r = data["machine"], data["run"]
    lines = [f"`python benchmarks/lora.py` ({m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, "
             f"{data['date']}): SmolLM2-135M-Instruct, bfloat16 over its Q4_1 blocks, one request, plain greedy "
             f"decoding, {data['prompts']} held-out prompts (half chat, half code) x 128 tokens, each once per "
             "engine, the engines in rotating order; a random PEFT adapter of each rank on all seven projections "
             "of the 30 layers" + (f"; an engine loading {data['modules']} such adapters of rank {data['ranks'][0]} "
                                   "that each request picks from (lora_modules), asked with the first and with none"
                                   if data.get("modules") else "") +
             (f"; an engine with {data['slots']} slots of rank {data['slot_rank']} for adapters loaded while it runs "
              f"(enable_lora), one of rank {data['ranks'][0]} loaded, asked with it and with none"
              if data.get("slots") else "") +
             ". Decode tok/s, median (quartiles); over base: prompt by prompt, the median.", "",
             "| engine | decode tok/s | over base | steps in one C++ call |", "|---|---|---|---|"]
    for name, q in r["speed"].items():
        over = f"{r['over base'][name]:.3f}x" if name in r["over base"] else "-"
        lines.append(f"| {name} | {spread(q)} | {over} | {r['one call'][name]} |")
    if r.get("load ms"):
        lines += ["", f"Loading the rank-{data['ranks'][0]} adapter into a slot (Engine.load_lora: read, fuse, write "
                      f"in place) {r['load ms']['load']:.0f} ms, unloading it {r['load ms']['unload']:.1f} ms "
                      "(median of 5)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts of each kind (chat, code)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--modules", type=int, default=4, help="adapters of the first rank each request picks from (0: "
                    "no such engine)")
    ap.add_argument("--slots", type=int, default=2, help="slots of an engine loading adapters while it runs (0: no "
                    "such engine)")
    ap.add_argument("--slot-rank", type=int, default=16, help="that engine's max_lora_rank")
    ap.add_argument("--tag", default="", help="a suffix for the results and the section (a host)")
    a = ap.parse_args()
    ep = eval_prompts()
    prompts = [p["prompt"] for kind in ("chat", "code") for p in ep[kind][:a.prompts]]
    with tempfile.TemporaryDirectory() as scratch:
        data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "prompts": len(prompts),
                "ranks": a.ranks, "modules": a.modules, "slots": a.slots, "slot_rank": a.slot_rank,
                "run": run(prompts, a.ranks, Path(scratch), a.modules, a.slots, a.slot_rank)}
    name = "lora" + (f"-{a.tag}" if a.tag else "")
    write_json(name, data)
    update_doc_section(name, f"## What a LoRA adapter costs a decode step: {name}\n\n" + render(data))
    print(render(data))


if __name__ == "__main__":
    main()
