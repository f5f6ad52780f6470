"""Two EAGLE-3 heads side by side on SmolLM2 (issue 33: a head's acceptance against the cost of its draft step).

    python benchmarks/eagle3_ab.py --candidate DIR [--baseline DIR] [--passes 3] [--prompts 24] [--tag T]

SmolLM2-135M-Instruct as `infer chat` runs it (bfloat16 over its GGUF's Q4_1 blocks, compiled, one request). Per head
(the baseline: the shipped src/infer/drafters/smollm2-eagle3): the head alone at K = 4 pinned (alpha per draft
position, as benchmarks/drafters.py counts it, over every recorded pass), c and v from the cost model of the defaults'
engine drafting with that head after the passes (a draft step in a round of 4 over a decode step; a verify of 5
tokens; the start-up profile's figures, refined by the rounds' own times as benchmarks/drafters.py reads them: a fresh
profile alone reads c 2-3x higher) and Leviathan's prediction from them; and the defaults (the suffix tree's copies
beside that head, auto K) against plain decoding. Held-out prompts (src/infer/drafters/eval_prompts.json, half chat,
half code) x 128 tokens, greedy and at temperature 0.7; every engine runs every prompt once a pass, the engines' order
alternating pass by pass, pass 0 a warm-up; per pass each engine's decode tok/s (first token to last) and its ratio to
plain decoding's in that pass, the median ratio reported. The suffix tree is emptied before each request
(benchmarks/drafters.py says why). Greedy outputs are compared with plain decoding's.
Writes benchmarks/results/eagle3_ab[-T].json and the "eagle3-ab[-T]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, quartiles, update_doc_section, write_json  # noqa: E402
from drafters import cost_terms, leviathan, position_stats  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, drafter_paths, real_model_path  # noqa: E402
from infer.drafters import eval_prompts  # noqa: E402

K = 4


def head_info(path: Path) -> dict:
    spec = json.loads((path / "config.json").read_text())["infer_drafter"]
    return {"path": str(path), "intermediate_size": spec["intermediate_size"],
            "draft_vocab": spec.get("draft_vocab_size"), "bytes": (path / "model.safetensors").stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidate", type=Path, required=True, help="an EAGLE-3 drafter directory")
    ap.add_argument("--baseline", type=Path, default=None, help="default: the shipped head")
    ap.add_argument("--passes", type=int, default=3, help="recorded passes per engine (after a warm-up pass)")
    ap.add_argument("--prompts", type=int, default=24, help="per kind (chat, code)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    if a.passes < 2 or a.prompts < 1:
        ap.error("--passes must be at least 2 (each side's quartiles) and --prompts at least 1")
    name = "eagle3_ab" + (f"-{a.tag}" if a.tag else "")
    heads = {"baseline": a.baseline or drafter_paths()["eagle3"], "candidate": a.candidate}
    for h, p in heads.items():
        if not (Path(p) / "config.json").exists():
            raise SystemExit(f"--{h} {p}: no config.json there (an EAGLE-3 drafter directory is asked for)")
    S = {**REAL_MODEL_SETTINGS, "max_batch_size": 1, "compile_in_background": False}
    llms = {"plain": LLM(real_model_path(), **S)}
    for h, p in heads.items():
        llms[f"{h} defaults"] = LLM(real_model_path(), **S, draft_model=p, proposer="suffix-hybrid")
        llms[f"{h} K={K}"] = LLM(real_model_path(), **S, draft_model=p, spec_length=K)
    tok = llms["plain"].tokenizer
    ep = eval_prompts()
    prompts = [p["prompt"] for p in ep["chat"][:a.prompts] + ep["code"][:a.prompts]]
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    res = {"machine": machine(), "prompts": len(ids), "passes": a.passes, "k": K,
           "heads": {h: head_info(Path(p)) for h, p in heads.items()},
           "settings": {k: str(v) for k, v in S.items()}, "temperatures": {}}
    for temp in (0.0, 0.7):
        per, outs_all, texts = {n: [] for n in llms}, {n: [] for n in llms}, {}
        for rep in range(a.passes + 1):
            for n in (list(llms) if rep % 2 == 0 else list(llms)[::-1]):
                outs = []
                for i, x in enumerate(ids):
                    dec = llms[n].engine.decoder
                    if dec is not None:  # the suffix tree starts each request empty (drafters.py)
                        getattr(dec.proposer, "clear", lambda: None)()
                    outs.append(llms[n].generate([x], SamplingParams(temperature=temp, max_tokens=128,
                                                                     seed=1000 * rep + i))[0])
                if rep:
                    s = sum(o.metrics["finish_time"] - o.metrics["first_token_time"] for o in outs)
                    per[n].append(sum(len(o.token_ids) - 1 for o in outs) / s)
                    outs_all[n] += outs
                texts[n] = [o.token_ids for o in outs]
        row = {"decode_tok_s": {n: quartiles(v) for n, v in per.items()}, "ratio": {}, "same_tokens": {}}
        for n in llms:
            if n == "plain":
                continue
            ratio = [x / p for x, p in zip(per[n], per["plain"])]
            row["ratio"][n] = {"by_pass": ratio, "median": statistics.median(ratio)}
            if temp == 0:
                row["same_tokens"][n] = texts[n] == texts["plain"]
        for h in heads:
            st = position_stats(outs_all[f"{h} K={K}"])
            terms = cost_terms(llms[f"{h} defaults"].engine.decoder.spec_length.costs, K)
            row[h] = {**st, **terms, "leviathan": leviathan(st["alpha"], K, terms["c"], terms["v"])}
        res["temperatures"][str(temp)] = row
        print(temp, row, flush=True)
    for llm in llms.values():
        llm.close()
    write_json(name, res)
    update_doc_section(name.replace("_", "-"), render(res, a.tag))


def render(res: dict, tag: str) -> str:
    m = res["machine"]
    hs = res["heads"]
    desc = "; ".join(f"{h}: {Path(i['path']).name}, MLP {i['intermediate_size']}, draft vocabulary {i['draft_vocab']}, "
                     f"{i['bytes'] / 1e6:.1f} MB" for h, i in hs.items())
    lines = [f"`python benchmarks/eagle3_ab.py{' --tag ' + tag if tag else ''}` ({m['cpu']}, {m['cores']} cores, "
             f"{m['date']}). SmolLM2-135M-Instruct as `infer chat` runs it; {desc}. {res['prompts']} held-out prompts "
             f"x 128 tokens, {res['passes']} recorded passes, engines alternating. alpha at K = {res['k']} pinned "
             "(per position); c and v from the defaults' cost model with that head; the defaults' decode over plain "
             "decoding's, median of the passes' ratios.", "",
             "| temperature | head | alpha | per position | c | v | Leviathan | K = 4 over plain | defaults over plain "
             "| same tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t, r in res["temperatures"].items():
        for h in hs:
            x, pinned = r[h], r["ratio"][f"{h} K={res['k']}"]["median"]
            pos = " ".join(f"{p:.2f}" for p in x["alpha_per_position"] if p is not None)
            same = r["same_tokens"].get(f"{h} defaults")
            lines.append(f"| {t} | {h} | {x['alpha']:.3f} | {pos} | {x['c']:.3f} | {x['v']:.2f} | "
                         f"{x['leviathan']:.2f}x | {pinned:.3f}x | "
                         f"**{r['ratio'][f'{h} defaults']['median']:.3f}x** | {'-' if same is None else same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
