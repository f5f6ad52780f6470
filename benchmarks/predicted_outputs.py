"""OpenAI's predicted outputs on SmolLM2-135M-Instruct: a request that brings the text its answer is expected to repeat
(``prediction``; ``LLM.generate(..., predictions=...)``), against the same request without it.

    python benchmarks/predicted_outputs.py [--prompts 4] [--repeats 3] [--new-tokens 256] [--tag predicted-outputs]
    python benchmarks/predicted_outputs.py --render

The engine runs SmolLM2's defaults (``LLM("smollm2", max_batch_size=1)``: its Q4_1 blocks in bfloat16, the suffix
tree's copies beside the EAGLE-3 head, auto K), one request at a time, greedy. For each held-out prompt (the first
``--prompts`` chat and code prompts of src/infer/drafters/eval_prompts.json) a first run gives the answer A; then
three variants take the prompt in turn, ``--repeats`` times, rotating their order:

- "none": no prediction (the defaults as they are);
- "exact": the prediction is A itself (regenerating an answer that is known, the most a prediction can give);
- "edited": A with one word in ten replaced (a file edited here and there: the copies resync after each change).

The suffix tree is emptied before every run (each meets the prompt unseen, as the first time; a tree kept across
runs would copy the earlier answer whatever the prediction). Decode speed = tokens after the first / time after the
first token, per variant the median over prompts and runs (quartiles beside it); "same tokens" checks every run's
output against the first answer (a prediction changes the speed only). Written to results/<tag>.json and the
docs/benchmarks.md section of that name."""

from __future__ import annotations

import argparse
import statistics

from common import machine, quartiles, results_of, spread, update_doc_section

VARIANTS = ("none", "exact", "edited")


def edited(text: str) -> str:
    """One word in ten replaced: the prediction is right in between."""
    words = text.split(" ")
    return " ".join("changed" if i % 10 == 5 else w for i, w in enumerate(words))


def run(args) -> dict:
    from infer import LLM, SamplingParams
    from infer.drafters import eval_prompts

    llm = LLM("smollm2", max_batch_size=1)
    held = eval_prompts()
    prompts = [(kind, p["prompt"]) for kind in ("chat", "code") for p in held[kind][:args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    rows = []
    for i, (kind, text) in enumerate(prompts):
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        llm.engine.decoder.proposer.clear()
        first = llm.generate([ids], params)[0]
        pred = {"none": None, "exact": first.text, "edited": edited(first.text)}
        for rep in range(args.repeats):
            k = (i + rep) % len(VARIANTS)
            for name in VARIANTS[k:] + VARIANTS[:k]:
                llm.engine.decoder.proposer.clear()
                o = llm.generate([ids], params, predictions=[pred[name]])[0]
                m = o.metrics
                rows.append({"kind": kind, "prompt": i, "rep": rep, "variant": name, "tokens": len(o.token_ids),
                             "decode_s": m["finish_time"] - m["first_token_time"],
                             "accepted": o.num_accepted_tokens, "tokens_per_forward": o.mean_accepted_length,
                             "same": o.token_ids == first.token_ids})
    llm.close()
    return {"machine": machine(), "args": vars(args), "rows": rows}


def render(res: dict) -> str:
    rows, args = res["rows"], res["args"]
    speed = {v: [(r["tokens"] - 1) / r["decode_s"] for r in rows if r["variant"] == v] for v in VARIANTS}
    base = {(r["prompt"], r["rep"]): (r["tokens"] - 1) / r["decode_s"] for r in rows if r["variant"] == "none"}
    lines = [f"`python benchmarks/predicted_outputs.py` ({res['machine'].get('cpu', '?')}, "
             f"{res['machine'].get('cores', '?')} cores, {res['machine'].get('date', '')}): SmolLM2-135M-Instruct as "
             f"`LLM(\"smollm2\")` runs it (Q4_1 blocks in bfloat16, suffix-hybrid with the EAGLE-3 head, auto K), one "
             f"request, greedy, {args['prompts']} chat + {args['prompts']} code held-out prompts x {args['repeats']} "
             f"runs a variant, up to {args['new_tokens']} tokens, the suffix tree emptied before each run.", "",
             "| prediction | decode tok/s (median, quartiles) | over none, same prompt and run | accepted drafts "
             "a run | tokens a target forward | same tokens |", "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        mine = [r for r in rows if r["variant"] == v]
        over = [(r["tokens"] - 1) / r["decode_s"] / base[r["prompt"], r["rep"]] for r in mine]
        q = quartiles(over)
        lines.append(f"| {v} | {spread(quartiles(speed[v]))} | {q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f}) | "
                     f"{statistics.median(r['accepted'] for r in mine):.0f} | "
                     f"{statistics.median(r['tokens_per_forward'] for r in mine):.2f} | "
                     f"{all(r['same'] for r in mine)} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="chat and code prompts each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--tag", default="predicted-outputs")
    ap.add_argument("--render", action="store_true", help="redraw the table from the stored results")
    args = ap.parse_args()
    res = results_of(args.tag, args.render, lambda: run(args))
    md = f"## Predicted outputs on SmolLM2: {args.tag}\n\n" + render(res)
    update_doc_section(args.tag, md)
    print(md)


if __name__ == "__main__":
    main()
