"""A speculating engine held at K = 0 beside a plain engine (issue 33: "within 2%").

    python benchmarks/k0_step.py [--passes 4] [--prompts 4] [--tag T]

SmolLM2-135M-Instruct as `infer chat` runs it (bfloat16 over its GGUF's Q4_1 blocks, compiled, one request): a plain
engine, and the defaults' speculating engine (the suffix tree, else the EAGLE-3 head) whose auto K is told to answer
k = 0 every step. That engine still does everything a speculating engine's plain step does but draft: the target's
forward with the head's captured layers, the features handed to the head, the round's bookkeeping. Auto K's own
pricing is left out (its choice is replaced), since a speculating engine that could never draft would not price.
Held-out prompts (half chat, half code) x 128 tokens, the engines pass by pass in alternating order after a
warm-up pass; per pass the decode tok/s (first token to last) of each, and their ratio. Greedy outputs are compared.
Writes benchmarks/results/k0_step[-T].json and the "k0-step[-T]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, quartiles, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=4, help="recorded passes per engine (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=4, help="per kind (chat, code)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    name = "k0_step" + (f"-{a.tag}" if a.tag else "")
    S = {**REAL_MODEL_SETTINGS, "max_batch_size": 1, "compile_in_background": False}
    llms = {"plain": LLM(real_model_path(), **S), "K = 0": LLM(real_model_path(), **S, **real_model_speculation())}
    llms["K = 0"].engine.decoder.spec_length.choose = lambda reqs, caps: [0] * len(reqs)
    tok = llms["plain"].tokenizer
    ep = eval_prompts()
    prompts = [p["prompt"] for p in ep["chat"][:a.prompts] + ep["code"][:a.prompts]]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    res = {"machine": machine(), "prompts": len(ids), "passes": a.passes, "settings": {k: str(v) for k, v in S.items()},
           "temperatures": {}}
    for temp in (0.0, 0.7):
        per, texts = {n: [] for n in llms}, {}
        for rep in range(a.passes + 1):
            for n in (list(llms) if rep % 2 == 0 else list(llms)[::-1]):
                outs = [llms[n].generate([x], SamplingParams(temperature=temp, max_tokens=128, seed=0))[0]
                        for x in ids]
                if rep:
                    s = sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outs)
                    per[n].append(sum(len(o.token_ids) - 1 for o in outs) / s)
                texts[n] = [o.token_ids for o in outs]
        ratio = [k / p for k, p in zip(per["K = 0"], per["plain"])]
        res["temperatures"][str(temp)] = {"decode_tok_s": {n: quartiles(v) for n, v in per.items()},
                                          "ratio_by_pass": ratio, "ratio_median": statistics.median(ratio),
                                          "same_tokens": texts["K = 0"] == texts["plain"] if temp == 0 else None}
        print(temp, res["temperatures"][str(temp)], flush=True)
    for llm in llms.values():
        llm.close()
    write_json(name, res)
    m = res["machine"]
    lines = [f"`python benchmarks/k0_step.py{' --tag ' + a.tag if a.tag else ''}` ({m['cpu']}, {m['cores']} cores, "
             f"{m['date']}). SmolLM2-135M-Instruct as `infer chat` runs it; the defaults' speculating engine with auto "
             f"K's choice replaced by k = 0, beside a plain engine; {res['prompts']} held-out prompts x 128 tokens, "
             f"{res['passes']} recorded passes alternating; decode tok/s, median [quartiles].", "",
             "| temperature | plain | speculating at K = 0 | ratio by pass | median ratio | same tokens |",
             "|---|---|---|---|---|---|"]
    for t, r in res["temperatures"].items():
        q = r["decode_tok_s"]
        cell = lambda d: f"{d['median']:.1f} [{d['q1']:.1f}, {d['q3']:.1f}]"  # noqa: E731
        lines.append(f"| {t} | {cell(q['plain'])} | {cell(q['K = 0'])} | "
                     + ", ".join(f"{x:.3f}" for x in r["ratio_by_pass"]) + f" | **{r['ratio_median']:.3f}x** | "
                     + ("-" if r["same_tokens"] is None else str(r["same_tokens"])) + " |")
    update_doc_section(name.replace("_", "-"), "\n".join(lines))


if __name__ == "__main__":
    main()
