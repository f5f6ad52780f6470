"""The prefix cache on SmolLM2's conversations (on by default since 2026-12-07): each next turn with the cache against
the same turn without it, and the drafter's acceptance over cached prefixes.

    python benchmarks/prefix_cache.py [--conversations 4] [--repeats 2] [--tag zen3]

Two engines in one process, both as ``LLM("smollm2")`` runs it (bfloat16 over its Q4_1 blocks, the default drafter:
the suffix tree beside the EAGLE-3 head, auto K, one request at a time), one with ``enable_prefix_caching=False``.
A conversation is a held-out question (``src/infer/drafters/eval_prompts.json``) and two follow-ups, each turn's prompt
the whole conversation so far with the answers the cache-off engine gave, so both engines see the same prompts (the
cache-on engine's own answer, where it parts from that one at a bfloat16 near-tie, caches less of the next turn).
Each turn runs on both engines back to back, which one first alternating; greedy, 96 tokens. Each repeat starts from
empty caches and suffix trees (``reset_prefix_cache``, the proposer's ``clear``): a repeat would otherwise find the
last one's whole prompts and answers. Per turn: time to first token (queueing, prefill and the first token), decode
tok/s from the first token to the last, the prompt tokens served from the cache. Writes
benchmarks/results/prefix_cache[-tag].json and the "prefix-cache[-tag]" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, quartiles, update_doc_section, write_json  # noqa: E402

FOLLOW_UPS = ["Give me one more example of that.", "Now say it all in one sentence."]
MAX_TOKENS = 96


def run(conversations: int, repeats: int) -> dict:
    from infer import LLM, SamplingParams
    from infer.drafters import eval_prompts

    engines = {"cache": LLM("smollm2", max_batch_size=1, compile_in_background=False),
               "no cache": LLM("smollm2", max_batch_size=1, compile_in_background=False,
                               enable_prefix_caching=False)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    questions = [p["prompt"] for p in eval_prompts()["chat"][:conversations]]
    turns, flip = [], 0
    for rep in range(repeats):
        for llm in engines.values():
            llm.reset_prefix_cache()
            getattr(llm.engine.decoder.proposer, "clear", lambda: None)()
        for c, q in enumerate(questions):
            history = []
            for t, text in enumerate([q] + FOLLOW_UPS):
                history.append({"role": "user", "content": text})
                rec = {"repeat": rep, "conversation": c, "turn": t}
                order = list(engines) if flip % 2 == 0 else list(engines)[::-1]
                flip += 1
                for name in order:
                    st = engines[name].engine.stats
                    before = (st.num_draft_tokens, st.num_accepted_tokens)
                    o = engines[name].chat(history, params)
                    m = o.metrics
                    rec[name] = {"ttft_s": m["first_token_time"] - m["arrival_time"],
                                 "decode_tok_s": (len(o.token_ids) - 1) / (m["finish_time"] - m["first_token_time"]),
                                 "prompt_tokens": len(o.prompt_token_ids), "cached": o.num_cached_tokens,
                                 "drafted": st.num_draft_tokens - before[0],
                                 "accepted": st.num_accepted_tokens - before[1], "tokens": list(o.token_ids),
                                 "text": o.text}
                history.append({"role": "assistant", "content": rec["no cache"]["text"]})
                rec["same_tokens"] = rec["cache"]["tokens"] == rec["no cache"]["tokens"]
                for name in engines:
                    del rec[name]["tokens"]
                turns.append(rec)
                print(f"rep {rep} conv {c} turn {t}: ttft {rec['cache']['ttft_s']:.3f} / "
                      f"{rec['no cache']['ttft_s']:.3f} s, cached {rec['cache']['cached']} of "
                      f"{rec['cache']['prompt_tokens']}", flush=True)
    return {"machine": machine(), "model": "SmolLM2-135M-Instruct Q4_1 (bfloat16), the default drafter",
            "max_tokens": MAX_TOKENS, "conversations": conversations, "repeats": repeats,
            "follow_ups": FOLLOW_UPS, "turns": turns, "summary": summarize(turns)}


def summarize(turns: list[dict]) -> dict:
    out = {}
    for label, sel in (("first turns (at most the template's system prompt cached)", lambda r: r["turn"] == 0),
                       ("next turns", lambda r: r["turn"] > 0)):
        rows = [r for r in turns if sel(r)]
        if not rows:
            continue

        def acc(name):
            d = sum(r[name]["drafted"] for r in rows)
            return sum(r[name]["accepted"] for r in rows) / d if d else None
        out[label] = {
            "turns": len(rows),
            "ttft_off_over_on": quartiles([r["no cache"]["ttft_s"] / r["cache"]["ttft_s"] for r in rows]),
            "ttft_s": {n: statistics.median(r[n]["ttft_s"] for r in rows) for n in ("cache", "no cache")},
            "decode_on_over_off": quartiles([r["cache"]["decode_tok_s"] / r["no cache"]["decode_tok_s"]
                                             for r in rows]),
            "cached_share": sum(r["cache"]["cached"] for r in rows) / sum(r["cache"]["prompt_tokens"] for r in rows),
            "prompt_tokens": statistics.median(r["cache"]["prompt_tokens"] for r in rows),
            "acceptance": {n: acc(n) for n in ("cache", "no cache")},
            "same_tokens": sum(r["same_tokens"] for r in rows),
        }
    return out


def render(res: dict, tag: str) -> str:
    m = res["machine"]
    md = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, revision {m['revision']}, {m['date']}. "
          f"{res['model']}; {res['conversations']} conversations of 3 turns x {res['repeats']} repeats, greedy, "
          f"{res['max_tokens']} tokens; each turn on both engines back to back, the order alternating "
          "(`python benchmarks/prefix_cache.py`).", "",
          "| turns | n | prompt tokens (median) | cached | time to first token, cache / none (median) | "
          "TTFT none over cache (median, quartiles) | decode cache over none | acceptance cache / none | "
          "same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for label, s in res["summary"].items():
        q, d = s["ttft_off_over_on"], s["decode_on_over_off"]
        a = s["acceptance"]
        md.append(f"| {label} | {s['turns']} | {s['prompt_tokens']:.0f} | {100 * s['cached_share']:.0f}% | "
                  f"{1000 * s['ttft_s']['cache']:.0f} / {1000 * s['ttft_s']['no cache']:.0f} ms | "
                  f"{q['median']:.2f}x ({q['q1']:.2f}-{q['q3']:.2f}) | {d['median']:.2f}x ({d['q1']:.2f}-{d['q3']:.2f})"
                  f" | {a['cache'] or 0:.3f} / {a['no cache'] or 0:.3f} | {s['same_tokens']} of {s['turns']} |")
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    name = "prefix_cache" + (f"-{a.tag}" if a.tag else "")
    res = run(a.conversations, a.repeats)
    write_json(name, res)
    section = "prefix-cache" + (f"-{a.tag}" if a.tag else "")
    update_doc_section(section, render(res, section))
    print(render(res, section))


if __name__ == "__main__":
    main()
