"""SmolLM2-135M-Instruct with its trained drafters, against plain decoding, transformers' assisted generation and
llama.cpp's own speculation.

    python benchmarks/drafters.py [--repeats 3] [--prompts 4] [--new-tokens 128] [--no-hf]
                                  [--llama-dir LLAMA_CPP/build/bin --llama-src LLAMA_CPP]

The target runs at its served setting (the GGUF's own Q4_1 blocks, bfloat16, compiled decode steps: infer.demo's
REAL_MODEL_SETTINGS). Prompts: the held-out chat and code prompts of src/infer/drafters/eval_prompts.json (drafter
training never saw them), chat template applied, one request at a time, greedy and temperature 0.7. Every variant
runs every prompt once per round, rounds repeated (A B C A B C ...; round 0 is a warm-up and not recorded); per
variant and prompt the median time, tokens/s = all tokens / sum of medians, end to end (prefill included, as for
transformers). A proposer that learns across requests (the defaults' suffix tree) is emptied before each generation,
so every prompt meets it unseen (the rounds repeat the prompts). Per drafter: acceptance per draft position
(conditional: accepted at i / accepted at i-1), alpha (all accepted / all judged), mean accepted length (tokens per
target forward), c (a draft step over a target decode step, from the engine's cost model) and Leviathan's predicted
speedup (1 - a^(K+1)) / ((1 - a)(K c + v)) at the pinned K,
with v the measured cost of verifying K+1 tokens over one decode step.
Drafters: every one shipped (src/infer/drafters: the distilled LM, the EAGLE-style and EAGLE-3 heads, the
Medusa-style heads), each with its defaults (auto K) and with K pinned, plus prompt lookup, and "ours defaults":
what `infer chat` runs on SmolLM2 (infer.demo.real_model_speculation).
Peers, same GGUF file and the same distilled drafter: transformers at its fastest CPU setting for it (float32),
``generate``, ``generate(assistant_model=smollm2-lm)`` and prompt lookup, in this process; llama.cpp
(benchmarks/llama_cpp.py, with --llama-dir) on the same prompts in the same rounds: plain decoding (llama-completion,
greedy), its speculation with smollm2-lm converted to GGUF (llama-speculative-simple, K = 4 and its default 3) and
its n-gram lookup (llama-lookup), plus llama-bench's token generation for each GGUF of the target given
(--llama-gguf: the fastest plain llama.cpp configuration). llama.cpp's times are its own (encode + decode).
Speeds: end to end (prefill included) and the decode phase alone (first token to last; llama.cpp's "decoded"
time), which is what llama-bench's tg measures.
Host state: before each recorded run common.host_probe (~30 ms) reads what the shared host's 2 cores give right now,
and each variant's decode ratio over plain decoding is also given over the prompt pairs both of whose runs read quiet
and over those both read contended (common.by_host_state; every run is stored with its probe; --no-probe leaves the
probe out).
Writes benchmarks/results/<tag>.json, the "<tag>" section of docs/benchmarks.md and <tag>.png (``--tag``, default
"drafters"; another machine's run keeps its own: ``--tag drafters-avx2``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUIET_SCALING, RESULTS, by_host_state, host_probe, machine, quartiles,  # noqa: E402
                    update_doc_section, write_json)

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import REAL_MODEL_SETTINGS, drafter_paths, real_model_path, real_model_speculation  # noqa: E402
from infer.drafters import KINDS, eval_prompts  # noqa: E402

PINNED_K = 4


def position_stats(outs) -> dict:
    def summed(key):  # per position, over requests whose lists differ in length (auto K drafts 0..K_max)
        lists = [o.metrics[key] for o in outs]
        return [sum(x[i] for x in lists if i < len(x)) for i in range(max(map(len, lists), default=0))]

    acc, drafted = summed("accepted_per_position"), summed("drafted_per_position")
    # position i is judged only in rounds that drafted it and accepted i-1: exact for a pinned K, and at most
    # min(accepted at i-1, drafted at i) when K varies by round (auto K), which is what is used then
    judged = [drafted[0]] + [min(a, d) for a, d in zip(acc[:-1], drafted[1:])] if drafted else []
    cond = [a / j if j else None for a, j in zip(acc, judged)]
    forwards = sum(len(o.token_ids) / o.mean_accepted_length for o in outs if o.mean_accepted_length)
    return {"alpha_per_position": cond, "alpha": sum(acc) / sum(judged) if judged and sum(judged) else None,
            "acceptance_rate": sum(acc) / sum(drafted) if drafted and sum(drafted) else None,
            "mean_accepted_length": sum(len(o.token_ids) for o in outs) / forwards if forwards else None}


def cost_terms(costs, k: int) -> dict:
    """A cost model's terms for one row at K = k, in target decode steps: c (a draft step's mean cost in a round of k;
    rounds are priced whole, per number of drafts: CostModel.draft_cost), c_first (a round of one draft), c_step (what
    each further draft adds) and v (a verify of k + 1 tokens)."""
    d1 = costs.verify_cost(1, 1)
    return {"c": costs.draft_cost(1, k) / k / d1, "v": costs.verify_cost(1, k + 1) / d1,
            "c_first": costs.draft_cost(1, 1) / d1,
            "c_step": (costs.draft_cost(1, k) - costs.draft_cost(1, 1)) / max(1, k - 1) / d1}


def leviathan(alpha: float, k: int, c: float, v: float) -> float:
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + v)) if alpha < 1 else (k + 1) / (k * c + v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="per kind (chat, code)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--no-hf", action="store_true", help="leave out the transformers peers")
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only the variants naming one")
    ap.add_argument("--llama-dir", type=Path, default=None, help="llama.cpp's build/bin (benchmarks/llama_cpp.py)")
    ap.add_argument("--llama-src", type=Path, default=None, help="llama.cpp's source tree (converts smollm2-lm)")
    ap.add_argument("--llama-gguf", type=Path, nargs="*", default=[],
                    help="more GGUF files of the target for llama-bench (e.g. its Q8_0; the shipped Q4_1 always)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tag", default="drafters", help="results/<tag>.json, docs/benchmarks.md's <tag> section and "
                    "results/<tag>.png")
    ap.add_argument("--no-probe", action="store_true", help="leave out the host probe before each recorded run")
    ap.add_argument("--render", action="store_true", help="only rewrite the table and plot from the last results")
    a = ap.parse_args()
    if a.render:
        import json

        res = json.loads((RESULTS / f"{a.tag}.json").read_text())
        update_doc_section(a.tag, render(res, a.tag))
        plot(res, a.tag)
        return
    torch.manual_seed(0)
    path, drafters = real_model_path(), drafter_paths()
    if "draft_model" not in drafters:
        raise SystemExit("no shipped distilled drafter (src/infer/drafters/smollm2-lm): train it first")
    lm = drafters["draft_model"]
    keep = (lambda n: True) if a.only is None else (lambda n: n == "ours AR" or any(x in n for x in a.only.split(",")))
    # one request at a time: a batch of one is all the engine needs (it profiles and compiles fewer shapes)
    # timed: graphs first; no prefix cache: the repeats of a prompt would hit it where a user's new prompt does not
    S = {**REAL_MODEL_SETTINGS, "max_batch_size": 1, "compile_in_background": False, "enable_prefix_caching": False}
    specs = {"ours AR": {}, "ours defaults": real_model_speculation()}
    for kind in [k for k in KINDS if k in drafters]:  # every shipped drafter, with defaults and with K pinned
        name = drafters[kind].name
        specs[f"ours + {name} (defaults)"] = {"draft_model": drafters[kind]}
        specs[f"ours + {name} K={PINNED_K}"] = {"draft_model": drafters[kind], "spec_length": PINNED_K}
    best = drafters.get("eagle3", drafters.get("eagle", lm))
    specs["ours ngram (defaults)"] = {"proposer": "ngram"}
    specs[f"ours hybrid {best.name} (defaults)"] = {"draft_model": best, "proposer": "hybrid"}
    ours = {n: LLM(path, **kw, **S) for n, kw in specs.items() if keep(n)}
    tok = ours["ours AR"].tokenizer
    eos = ours["ours AR"].eos_token_ids
    prompts = eval_prompts()
    chosen = [("chat", p) for p in prompts["chat"][:a.prompts]] + [("code", p) for p in prompts["code"][:a.prompts]]
    messages = [[{"role": "user", "content": p["prompt"]}] for _, p in chosen]
    ids = [tok.apply_chat_template(m) for m in messages]

    hf = {}
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        # transformers' own fastest CPU setting for this file: float32 (it says so when asked for bfloat16; its
        # GGUF kernels compute in float32 either way), and the drafter beside it in float32 too
        hf_t = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
        hf_d = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32).eval()
        hf = {n: kw for n, kw in {"transformers generate": {}, "transformers assisted (smollm2-lm)":
                                  {"assistant_model": hf_d},
                                  "transformers prompt lookup": {"prompt_lookup_num_tokens": 10}}.items() if keep(n)}

    llama, llama_info = {}, {}
    if a.llama_dir is not None:
        import llama_cpp as lc

        texts = [tok.hf.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        draft_gguf = None
        if a.llama_src is not None:
            draft_gguf = lc.convert_hf(a.llama_src, lm, RESULTS.parent / "cache" / f"{lm.name}-bf16.gguf")
        llama_info = {"build": lc.build_commit(a.llama_dir, path), "drafter_gguf": None if draft_gguf is None
                      else f"{lm.name} converted by convert_hf_to_gguf.py (bf16)"}

        def lrun(fn):
            return lambda i, temp: fn(texts[i], temp)

        llama["llama.cpp plain (Q4_1)"] = lrun(lambda t, temp: lc.plain(a.llama_dir, path, t, a.new_tokens, a.threads)
                                              if temp == 0 else None)
        if draft_gguf is not None:
            for k in (PINNED_K, 3):
                llama[f"llama.cpp speculative (smollm2-lm) K={k}"] = lrun(
                    lambda t, temp, k=k: lc.speculative(a.llama_dir, path, draft_gguf, t, a.new_tokens, temp, k,
                                                        a.threads))
        llama["llama.cpp lookup (n-gram)"] = lrun(lambda t, temp: lc.lookup(a.llama_dir, path, t, a.new_tokens, temp,
                                                                             PINNED_K, a.threads))
        llama = {n: f for n, f in llama.items() if keep(n)}

    results, host_state, runs, t_start = {}, {}, {}, time.perf_counter()
    for temp in [float(t) for t in a.temperatures.split(",")]:
        params = SamplingParams(temperature=temp, max_tokens=a.new_tokens, seed=0)
        hf_common = dict(max_new_tokens=a.new_tokens, pad_token_id=eos[0], eos_token_id=eos, do_sample=temp > 0)
        if temp > 0:
            hf_common.update(temperature=temp, top_k=0, top_p=1.0)

        def run(n, i):
            """-> {tokens, e2e_s, decode_s (None: not measured), out, drafted, accepted} for prompt i."""
            if n in llama:
                r = llama[n](i, temp)
                return None if r is None else {"tokens": r.tokens, "e2e_s": r.encode_s + r.decode_s,
                                               "decode_s": r.decode_s, "decode_tokens": r.tokens,
                                               "drafted": r.drafted, "accepted": r.accepted}
            if n in ours and ours[n].engine.decoder is not None:
                # a proposer that learns across requests (the suffix tree of the defaults) starts each one empty:
                # the rounds repeat each prompt, and a tree holding the last round's answer copies it whole
                # (2.8x "plain decoding" greedy, alpha 1.00), which says nothing of a prompt it has not seen
                getattr(ours[n].engine.decoder.proposer, "clear", lambda: None)()
            t0 = time.perf_counter()
            if n in ours:
                o = ours[n].generate([ids[i]], params)[0]
                dt, m = time.perf_counter() - t0, o.metrics
                return {"tokens": len(o.token_ids), "e2e_s": dt, "out": o,
                        "decode_s": m["finish_time"] - m["first_token_time"], "decode_tokens": len(o.token_ids) - 1}
            x = torch.tensor([ids[i]])
            with torch.inference_mode():
                out = hf_t.generate(x, attention_mask=torch.ones_like(x), **hf_common, **hf[n])[0, x.shape[1]:]
            return {"tokens": len(out), "e2e_s": time.perf_counter() - t0, "decode_s": None}

        names = list(ours) + list(hf) + list(llama)
        recs = {n: [[] for _ in ids] for n in names}
        for rep in range(a.repeats + 1):  # A B C A B C ...; round 0 warms up and is not recorded
            for i in range(len(ids)):
                for n in names:
                    # what the host's 2 cores give just before the run (common.host_probe), drawn before the seed
                    probe = host_probe() if rep and not a.no_probe else None
                    torch.manual_seed(1000 * rep + i)
                    r = run(n, i)
                    if rep and r is not None:
                        recs[n][i].append({**r, "probe": probe, "t": time.perf_counter() - t_start})
        rows = {}
        for n in names:
            if not all(recs[n]):  # a variant that does not run at this temperature (llama.cpp plain: greedy only)
                continue
            med = lambda key, i: statistics.median(r[key] for r in recs[n][i])  # noqa: E731
            toks = [recs[n][i][-1]["tokens"] for i in range(len(ids))]
            row = {"tok_s": sum(toks) / sum(med("e2e_s", i) for i in range(len(ids))), "tokens": sum(toks),
                   "per_kind_tok_s": {k: sum(t for t, (kk, _) in zip(toks, chosen) if kk == k)
                                      / sum(med("e2e_s", i) for i, (kk, _) in enumerate(chosen) if kk == k)
                                      for k in ("chat", "code")}}
            if recs[n][0][0]["decode_s"] is not None:
                row["decode_tok_s"] = sum(recs[n][i][-1]["decode_tokens"] for i in range(len(ids))) / sum(
                    med("decode_s", i) for i in range(len(ids)))
            outs = [recs[n][i][-1].get("out") for i in range(len(ids))]
            if n in ours and ours[n].engine.decoder is not None:
                row.update(position_stats(outs))
                for k in ("chat", "code"):
                    row[f"{k}_alpha"] = position_stats([o for o, (kk, _) in zip(outs, chosen) if kk == k])["alpha"]
            if n in llama and recs[n][0][0].get("drafted") is not None:
                drafted = sum(r["drafted"] or 0 for rs in recs[n] for r in rs)
                row["acceptance_rate"] = sum(r["accepted"] or 0 for rs in recs[n] for r in rs) / drafted \
                    if drafted else None
            if temp == 0 and n in ours:
                row["same_as_ours_AR"] = [o.token_ids for o in outs] == \
                    [recs["ours AR"][i][-1]["out"].token_ids for i in range(len(ids))]
            rows[n] = row
        if not a.no_probe:
            scalings = [r["probe"]["scaling"] for rs in recs["ours AR"] for r in rs]
            # every timed run as [seconds from the start, decode s, decode tokens, probe's scaling, its 1-thread
            # GFLOP/s], per variant and prompt, round by round: the host's phases against the ratio, run by run
            runs[str(temp)] = {n: [[[round(r["t"], 2), r["decode_s"], r["decode_tokens"],
                                     round(r["probe"]["scaling"], 3), round(r["probe"]["gflops_1"], 1)] for r in rs]
                                    for rs in recs[n]] for n in rows if rows[n].get("decode_tok_s") is not None}
            host_state[str(temp)] = {"probes": len(scalings), "scaling": quartiles(scalings)}
        base = rows["ours AR"]
        for r in rows.values():
            r["speedup_vs_ours_AR"] = r["tok_s"] / base["tok_s"]
            if "decode_tok_s" in r:
                r["decode_speedup_vs_ours_AR"] = r["decode_tok_s"] / base["decode_tok_s"]
        for kind in [k for k in KINDS if k in drafters]:  # Leviathan's prediction at the pinned K, per drafter
            name = drafters[kind].name
            # the cost model of an auto-K engine drafting with this drafter: its own defaults, else "ours defaults"
            # where that is the drafter the defaults draft with (a run with --only may leave either out)
            source = next((n for n in (f"ours + {name} (defaults)", "ours defaults") if n in ours and
                           Path(specs[n].get("draft_model", "")) == Path(drafters[kind])), None)
            if source is None or f"ours + {name} K={PINNED_K}" not in rows:
                continue
            costs = getattr(ours[source].engine.decoder.spec_length, "costs", None)
            pinned = rows[f"ours + {name} K={PINNED_K}"]
            if costs is not None and pinned.get("alpha") is not None:
                terms = cost_terms(costs, PINNED_K)
                results.setdefault("model_costs", {}).setdefault(str(temp), {})[name] = {
                    **terms, "cost_model_of": source}
                pinned["leviathan_predicted_speedup"] = leviathan(pinned["alpha"], PINNED_K, terms["c"], terms["v"])
        # the defaults' own terms (issue 33: where a target is missed, c and v as measured and the prediction from
        # them name the short term): their engine's cost model at K = PINNED_K and their alpha, copies included
        # (auto K varies K round by round and a copy's drafts cost nothing: a reference point, not their law)
        dflt, eng = rows.get("ours defaults"), ours.get("ours defaults")
        costs = getattr(eng.engine.decoder.spec_length, "costs", None) if dflt and eng else None
        if costs is not None and dflt.get("alpha") is not None:
            terms = cost_terms(costs, PINNED_K)
            results.setdefault("model_costs", {}).setdefault(str(temp), {})["ours defaults"] = {
                **terms, "cost_model_of": "ours defaults"}
            dflt["leviathan_predicted_speedup"] = leviathan(dflt["alpha"], PINNED_K, terms["c"], terms["v"])
        results[str(temp)] = rows
    if a.llama_dir is not None:  # llama.cpp's fastest plain configuration: llama-bench tg of each GGUF
        import llama_cpp as lc

        results["llama_bench_tg"] = {p.name: lc.bench_tg(a.llama_dir, p, a.new_tokens, a.threads)
                                     for p in [path, *a.llama_gguf]}
    res = {"machine": machine(), "model": "SmolLM2-135M-Instruct (GGUF, its own Q4_1 blocks)", "settings": S,
           "drafters": {k: str(d.relative_to(Path(__file__).resolve().parents[1])) for k, d in drafters.items()},
           "defaults": {k: (Path(v).name if k == "draft_model" else v) for k, v in real_model_speculation().items()},
           "pinned_k": PINNED_K, "llama_cpp": llama_info or None,
           "prompts": [{"kind": k, "source": p["source"]} for k, p in chosen], "new_tokens": a.new_tokens,
           "repeats": a.repeats, "results": results, "host_state": host_state or None,
           "runs": runs or None,
           "transformers_dtype": None if a.no_hf else "float32 (its fastest for this GGUF)"}
    write_json(a.tag, res)
    update_doc_section(a.tag, render(res, a.tag))
    plot(res, a.tag)
    print(render(res, a.tag))


def render(res: dict, tag: str = "drafters") -> str:
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    llama = res.get("llama_cpp") or {}
    # each machine's run keeps a section of its own: its heading names the run (the default tag's stays as it was)
    md = ["## SmolLM2-135M-Instruct with trained drafters (issues 16, 33)" + ("" if tag == "drafters" else f": {tag}"),
          "",
          f"`python benchmarks/drafters.py` ({res['machine']['cpu']}, {res['machine']['cores']} cores, "
          f"{res['machine']['date']}). Target: {res['model']}, {res['settings']}; {len(res['prompts'])} held-out "
          f"prompts (half chat, half code, never seen in drafter training), one request at a time, "
          f"{res['new_tokens']} new tokens at most, {res['repeats']} interleaved rounds, per prompt the median. "
          "tok/s end to end (prefill included); decode tok/s from the first token to the last (llama.cpp: its "
          "\"decoded\" time; what llama-bench's tg measures). \"ours defaults\" is what `infer chat` runs: "
          f"{res.get('defaults')}. alpha = accepted / judged drafts; per position conditional on the positions "
          "before it; c = draft step / target decode step; prediction = Leviathan's (1 - a^(K+1)) / ((1 - a)(Kc + "
          f"v)), v = verify of K+1 tokens / decode step, at K = {res['pinned_k']} (\"ours defaults\": their engine's "
          "cost model and their alpha, though auto K varies K and the suffix tree's copies cost no draft step). "
          "transformers "
          f"{_hf_version()}: {res.get('transformers_dtype')}. llama.cpp: "
          f"{llama.get('build') or 'not run'}{'; drafter: ' + llama['drafter_gguf'] if llama.get('drafter_gguf') else ''}"
          " (llama.cpp's acceptance column is its own n_accept / n_drafted). A proposer that learns across requests "
          "(the defaults' suffix tree) is emptied before each generation: every prompt meets it unseen.", ""]
    for temp, rows in res["results"].items():
        if temp in ("model_costs", "llama_bench_tg"):
            continue
        md += [f"**temperature {temp}**", "",
               "| variant | tok/s | vs ours AR | decode tok/s | vs ours AR | chat / code tok/s | alpha (chat / code) "
               "| alpha per position | tokens / target forward | predicted | same tokens as AR |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, r in rows.items():
            pk = r["per_kind_tok_s"]
            pos = " ".join(f(x) for x in (r.get("alpha_per_position") or [])[:6])
            alpha = f"{f(r.get('alpha'))} ({f(r.get('chat_alpha'))} / {f(r.get('code_alpha'))})" if "alpha" in r \
                else (f"accept {f(r['acceptance_rate'])}" if r.get("acceptance_rate") is not None else "-")
            md.append(f"| {n} | {r['tok_s']:.1f} | {r['speedup_vs_ours_AR']:.2f}x | {f(r.get('decode_tok_s'), 1)} | "
                      f"{f(r.get('decode_speedup_vs_ours_AR'))}{'x' if 'decode_speedup_vs_ours_AR' in r else ''} | "
                      f"{pk['chat']:.1f} / {pk['code']:.1f} | {alpha} | {pos or '-'} | "
                      f"{f(r.get('mean_accepted_length'))} | {f(r.get('leviathan_predicted_speedup'))} | "
                      f"{r.get('same_as_ours_AR', '-')} |")
        hs = (res.get("host_state") or {}).get(temp)
        runs = (res.get("runs") or {}).get(temp, {})
        by_state = {n: by_host_state(runs, n) for n in runs if n != "ours AR"}
        if hs:
            ar = [r[3] for rs in runs.get("ours AR", []) for r in rs]  # the share quiet at today's threshold
            share = f"{sum(x >= QUIET_SCALING for x in ar) / len(ar):.0%} of {len(ar)} probes quiet, " if ar else ""
            md += ["", "Host state (common.host_probe before each recorded run: a product in cache, 2 threads' rate "
                   f"over 1 thread's; quiet >= {QUIET_SCALING}): {share}scaling median {hs['scaling']['median']:.2f} "
                   f"(quartiles {hs['scaling']['q1']:.2f}-{hs['scaling']['q3']:.2f})" + (
                       ". Decode over plain decoding by state (pairs whose two probes agree): " + "; ".join(
                           f"{n}: " + ", ".join(f"{st} {v['decode_speedup']:.2f}x ({v['pairs']} pairs)"
                                                for st, v in by.items())
                           for n, by in by_state.items() if by) if any(by_state.values()) else "") + "."]
        mc = res["results"].get("model_costs", {}).get(temp)
        if mc:
            mc = mc if "c" not in mc else {"smollm2-lm": mc}  # results of the one-drafter version
            md += ["", "; ".join(f"{n}: c = {x['c']:.3f}"
                                 + (f" (a round of one {x['c_first']:.3f}, each further draft {x['c_step']:.3f})"
                                    if "c_first" in x else "") + f", v = {x['v']:.2f}"
                                 + (f" (the cost model of \"{x['cost_model_of']}\")" if "cost_model_of" in x else "")
                                 for n, x in mc.items())
                   + f" (K = {res['pinned_k']})"]
        md.append("")
    tg = res["results"].get("llama_bench_tg")
    if tg:
        md += ["llama.cpp plain decoding, `llama-bench -p 0 -n N` (tg): " + ", ".join(
            f"{name} {v:.1f} tok/s" for name, v in tg.items()) + ".", ""]
    md.append(f"![{tag}](../benchmarks/results/{tag}.png)")
    return "\n".join(md)


def _hf_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "(not installed)"


def plot(res: dict, tag: str = "drafters") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = [t for t in res["results"] if t not in ("model_costs", "llama_bench_tg")]
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rows = res["results"][t]
        names = list(rows)
        ax.barh(names, [rows[n]["speedup_vs_ours_AR"] for n in names],
                color=["tab:gray" if n == "ours AR" else "tab:blue" if n.startswith("ours") else
                       "tab:green" if n.startswith("llama.cpp") else "tab:orange" for n in names])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"SmolLM2-135M, temperature {t}")
        ax.set_xlabel("tokens/s vs ours AR (same dtype and quantization)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{tag}.png", dpi=110)


if __name__ == "__main__":
    main()
