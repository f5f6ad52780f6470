"""One request at a time on the shipped demo pair: infer vs Hugging Face transformers, same models, same process.

Variants (interleaved within each repeat, medians over repeats):
  ours AR                     autoregressive_generate on the target
  ours spec K=1..8, EGAG      speculative_generate with the distilled drafter scoring its draft vocabulary (the
                              --draft-vocab most frequent tokens plus the prompt's; lossless, see proposers.draft_vocab)
  ours spec K=k, full vocab   the same drafter scoring all 8,192 tokens (--full-vocab-ks), for the A/B in one run
  HF generate                 transformers LlamaForCausalLM.generate on the same target weights
  HF assisted (default)       generate(assistant_model=drafter) as transformers ships it (5.x: up to 20 drafts,
                              drafting stops early below the drafter's confidence 0.4)
  HF assisted (heuristic)     the older default schedule: K starts at 5, +2 after a full accept, -1 otherwise
  HF assisted K=k             a constant k drafts per round, no confidence stop
Transformers reads these settings from the *assistant's* generation_config (generate() kwargs are ignored for
them), so each HF assisted call sets that config first; every call starts from the same state.
  HF prompt lookup            generate(prompt_lookup_num_tokens=10)
Also measured: alpha (our per-position acceptance) and c (drafter step / target step, our runtime), Leviathan's
predicted speedup (1 - a^(K+1)) / ((1 - a)(Kc + 1)) next to the measured one, and per prompt the acceptance
and the share of repeated 4-grams in the output (a looping model would inflate acceptance). Diagnostics for the
gap to the formula: our variants' decode-phase speedup (first token to last, from the Request's timestamps; the
formula leaves the prefill out) and v, a (K+1)-token verify's cost in target steps, with the formula at that v.

    python benchmarks/single_request.py [--dtypes float32,bfloat16,bfloat16+float32] [--new-tokens 128] [--repeats 3]
                                        [--draft-vocab 2048] [--prompts 8]

A dtype entry "T+D" loads the target in T and the drafter in D (e.g. bfloat16+float32: a bf16 target, whose
K+1-token verify costs only 1.15-1.4x one step on this CPU's AMX units, with a float32 drafter, whose tiny matmuls are
cheaper in float32). Transformers gets the same pair of dtypes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, median, update_doc_section, write_json  # noqa: E402

from infer.demo import demo_model_paths, demo_prompts  # noqa: E402
from infer.generate import autoregressive_generate  # noqa: E402
from infer.model import load_model  # noqa: E402
from infer.sampling import SamplingParams, argmax  # noqa: E402
from infer.speculative import speculative_generate  # noqa: E402
from infer.proposers.draft_vocab import DraftVocab, load_ranking  # noqa: E402
from infer.cache import SlottedKVCache  # noqa: E402
from infer.spec_decode.theory import walltime_improvement  # noqa: E402
from infer.tokenizer import Tokenizer  # noqa: E402

HF_CONST_KS = (2, 4, 6, 8)


def repeated_4gram_share(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@torch.inference_mode()
def step_seconds(model, ids, n, head=None, width=1) -> float:
    """Median seconds of one greedy forward as the speculative loop runs it (``width`` tokens in: forward, the head's
    logits for all of them, argmax, one host sync; then the cache rolls back to one new token, as after a rejection
    at the first draft), over n forwards after the prompt, 3 repeats. width=1 is a decode step: target and drafter
    are timed alike, c = step_seconds(drafter, head=its draft-vocabulary head) / step_seconds(target). width=K+1
    is a verify: v = step_seconds(target, width=K+1) / step_seconds(target) is what it costs in target steps."""
    head = head or model.compute_logits
    times = []
    for _ in range(4):  # the first repeat warms up
        kv = SlottedKVCache.for_model(model, len(ids) + n + width + 1)
        slot = kv.allocate()

        def feed(tokens, last):
            meta = kv.prepare([slot], [len(tokens)])
            return head(model(torch.tensor([tokens], device=model.device), meta.positions, kv, meta)[0, -last:])

        feed(ids, 1)
        t, t0 = ids[-1], time.perf_counter()
        for _ in range(n):
            top = argmax(feed([t] * width, width)).tolist()  # indices into the head's rows: any valid id times the same
            kv.truncate_to(slot, kv.seq_len(slot) - width + 1)
            t = top[0]
        times.append((time.perf_counter() - t0) / n)
        kv.free(slot)
    return median(times[1:])


def run_config(dtype: str, temperature: float, prompts, a, hf_t, hf_d, target, drafter, draft_vocab) -> dict:
    greedy = temperature == 0
    params = SamplingParams(temperature=temperature, max_tokens=a.new_tokens, ignore_eos=True)
    n = a.new_tokens
    hf_common = dict(max_new_tokens=n, do_sample=not greedy, pad_token_id=0)
    if not greedy:
        hf_common.update(temperature=temperature, top_k=0, top_p=1.0)

    def hf(ids, **kw):
        x = torch.tensor([ids])
        with torch.inference_mode():
            return hf_t.generate(x, attention_mask=torch.ones_like(x), **hf_common, **kw)[0, len(ids):].tolist()

    decode = {}  # variant -> [prompt] -> seconds from the first token to the last (ours only: Request stamps them)

    def timed(name, req, i):
        decode.setdefault(name, [[] for _ in prompts])[i].append(req.finish_time - req.first_token_time)
        return req.output_ids

    variants = {"ours AR": lambda ids, s, i: timed("ours AR", autoregressive_generate(target, ids, _seeded(params, s), []), i)}
    spec_stats: dict[str, list] = {}

    def spec(k=None, egag=False, full_vocab=False):
        name = "ours EGAG" if egag else f"ours spec K={k}" + (", full vocab" if full_vocab else "")
        dv = None if full_vocab else draft_vocab

        def run(ids, s, i):
            out, st = speculative_generate(target, drafter, ids, _seeded(params, s),
                                           spec_length="egag" if egag else k, eos_token_ids=[], spec_length_min=1,
                                           spec_length_max=a.egag_max, draft_vocab=dv)
            spec_stats.setdefault(name, []).append((out, st))
            return timed(name, out, i)
        return name, run

    for k in a.ks:
        name, fn = spec(k)
        variants[name] = fn
    name, fn = spec(egag=True)
    variants[name] = fn
    for k in a.full_vocab_ks if draft_vocab is not None else []:
        name, fn = spec(k, full_vocab=True)
        variants[name] = fn
    variants["HF generate"] = lambda ids, s, i: hf(ids)
    def assisted(**draft_cfg):
        def run(ids, s, i):
            gc = hf_d.generation_config  # None = transformers' default; the heuristic schedule writes K back here
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = (
                draft_cfg.get("k"), draft_cfg.get("schedule"), draft_cfg.get("threshold"))
            return hf(ids, assistant_model=hf_d)
        return run

    variants["HF assisted (default)"] = assisted()
    variants["HF assisted (heuristic)"] = assisted(k=5, schedule="heuristic", threshold=0.0)
    for k in HF_CONST_KS:
        variants[f"HF assisted K={k}"] = assisted(k=k, schedule="constant", threshold=0.0)
    variants["HF prompt lookup"] = lambda ids, s, i: hf(ids, prompt_lookup_num_tokens=10)

    times = {v: [[] for _ in prompts] for v in variants}
    outputs = {v: [None] * len(prompts) for v in variants}
    for rep in range(a.repeats + 1):  # repeat 0 is a warm-up, not recorded
        for i, ids in enumerate(prompts):
            for v, fn in variants.items():
                torch.manual_seed(1000 * rep + i)  # HF samples from the global RNG
                t0 = time.perf_counter()
                out = fn(ids, 1000 * rep + i, i)
                dt = time.perf_counter() - t0
                if rep:
                    times[v][i].append(dt)
                    outputs[v][i] = out
                elif v in decode:
                    decode[v][i].clear()  # the warm-up's decode time is not recorded either
    # tokens/s per variant: all prompts' tokens over the sum of per-prompt median times
    tok_s = {v: sum(len(o) for o in outputs[v]) / sum(median(t) for t in times[v]) for v in variants}
    # decode phase: tokens after the first over the time after it (the prefill and first token are left out, as
    # Leviathan's formula leaves them out; end-to-end tokens/s above keeps them)
    decode_tok_s = {v: sum(len(o) - 1 for o in outputs[v]) / sum(median(t) for t in decode[v]) for v in decode}
    acc = {}
    for name, runs in spec_stats.items():
        judged = sum(r.tested for _, st in runs for r in st.rounds)
        acc[name] = {"acceptance_rate": sum(o.num_accepted_tokens for o, _ in runs) / sum(o.num_draft_tokens for o, _ in runs),
                     "alpha": sum(r.num_accepted for _, st in runs for r in st.rounds) / judged,
                     "expected_alpha": _mean([v for _, st in runs for r in st.rounds for v in r.expected_accept[: r.tested]]),
                     "tokens_per_target_forward": sum(len(o.output_ids) for o, _ in runs) / sum(o.num_target_forwards for o, _ in runs)}
    per_prompt = [{"prompt_tokens": len(ids), "ar_repeated_4gram_share": repeated_4gram_share(outputs["ours AR"][i]),
                   "acceptance": {v: _prompt_acc(runs, i, len(prompts)) for v, runs in spec_stats.items()}}
                  for i, ids in enumerate(prompts)]
    identical = {v: outputs[v] == outputs["ours AR"] for v in variants if v.startswith("ours")} if greedy else None
    hf_same = outputs["HF generate"] == outputs["ours AR"] if greedy else None
    return {"dtype": dtype, "temperature": temperature, "tokens_per_s": tok_s, "decode_tokens_per_s": decode_tok_s,
            "acceptance": acc,
            "per_prompt": per_prompt, "greedy_identical_to_ours_AR": identical, "HF_generate_identical": hf_same}


def _seeded(params, seed):
    return params if params.greedy else SamplingParams(**{**params.__dict__, "seed": seed})


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _prompt_acc(runs, i, n_prompts):
    if not runs:
        return None
    mine = [o for j, (o, _) in enumerate(runs) if j % n_prompts == i]
    return sum(o.num_accepted_tokens for o in mine) / max(1, sum(o.num_draft_tokens for o in mine))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16,bfloat16+float32",
                    help="comma-separated; T+D = target in T, drafter in D")
    ap.add_argument("--egag-max", type=int, default=6, help="EGAG's spec_length_max (spec_length_min is 1)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8, help="the first N held-out prompts (8 ship)")
    ap.add_argument("--draft-vocab", type=int, default=2048,
                    help="drafter scores this many most frequent tokens plus the prompt's (0: the full vocabulary)")
    ap.add_argument("--full-vocab-ks", default="2,6", help="also run these K with the full vocabulary ('': none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="1,2,3,4,5,6,8")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    a.ks = [int(k) for k in a.ks.split(",")]
    a.full_vocab_ks = [int(k) for k in a.full_vocab_ks.split(",") if k]
    torch.set_num_threads(a.threads)
    from transformers import LlamaForCausalLM as HF

    tdir, ddir = demo_model_paths()
    tok = Tokenizer(tdir)
    prompt_info = demo_prompts()[: a.prompts]
    prompts = [tok.encode(p["prompt"]) for p in prompt_info]
    results = {"benchmark": "single_request", "machine": machine(), "new_tokens": a.new_tokens,
               "draft_vocab": a.draft_vocab or None, "full_vocab_ks": a.full_vocab_ks,
               "repeats": a.repeats, "prompts": [{"module": p["module"], "tokens": len(ids)}
                                                 for p, ids in zip(prompt_info, prompts)], "configs": []}
    for dtype in a.dtypes.split(","):
        t_dtype, _, d_dtype = dtype.partition("+")
        d_dtype = d_dtype or t_dtype
        target, drafter = load_model(tdir, t_dtype), load_model(ddir, d_dtype)
        hf_t = HF.from_pretrained(tdir, dtype=getattr(torch, t_dtype)).eval()
        hf_d = HF.from_pretrained(ddir, dtype=getattr(torch, d_dtype)).eval()
        for m in (hf_t, hf_d):
            m.generation_config.eos_token_id = None  # fixed-length runs, like ignore_eos on our side
        dv = DraftVocab.from_ranking(drafter, load_ranking(ddir), a.draft_vocab) if a.draft_vocab else None
        t_step = step_seconds(target, prompts[0], 32)
        c_full = step_seconds(drafter, prompts[0], 32) / t_step
        c = c_full if dv is None else step_seconds(drafter, prompts[0], 32, dv.including(prompts[0]).logits) / t_step
        ks_all = sorted(set(a.ks) | set(a.full_vocab_ks))
        verify_cost = {k: step_seconds(target, prompts[0], 32, width=k + 1) / t_step for k in ks_all}
        print(f"{dtype}: target step {1e3 * t_step:.2f} ms, c={c:.3f} (full vocab {c_full:.3f}), verify cost v = "
              + ", ".join(f"K={k}: {v:.2f}" for k, v in verify_cost.items()), flush=True)
        for temp in (float(t) for t in a.temperatures.split(",")):
            r = run_config(dtype, temp, prompts, a, hf_t, hf_d, target, drafter, dv)
            r["c"], r["c_full_vocab"], r["target_step_ms"] = c, c_full, 1e3 * t_step
            r["verify_cost"] = {str(k): v for k, v in verify_cost.items()}
            ar = r["tokens_per_s"]["ours AR"]
            r["speedup"] = {v: s / ar for v, s in r["tokens_per_s"].items() if v.startswith("ours")}
            ar_d = r["decode_tokens_per_s"]["ours AR"]
            r["decode_speedup"] = {v: s / ar_d for v, s in r["decode_tokens_per_s"].items()}
            hf_ar = r["tokens_per_s"]["HF generate"]
            r["hf_speedup"] = {v: s / hf_ar for v, s in r["tokens_per_s"].items() if v.startswith("HF")}
            alpha = {v: min(acc["alpha"], 0.999999) for v, acc in r["acceptance"].items()}
            # predicted: the paper's formula (a verify costs one step); predicted_v: the same with the measured v
            r["predicted"], r["predicted_v"] = {}, {}
            for k in a.ks:
                name = f"ours spec K={k}"
                r["predicted"][name] = walltime_improvement(alpha[name], k, c)
                r["predicted_v"][name] = walltime_improvement(alpha[name], k, c, verify_cost[k])
            for k in a.full_vocab_ks:
                full = f"ours spec K={k}, full vocab"
                if full in alpha:
                    r["predicted"][full] = walltime_improvement(alpha[full], k, c_full)
                    r["predicted_v"][full] = walltime_improvement(alpha[full], k, c_full, verify_cost[k])
            results["configs"].append(r)
            print(f"{dtype} T={temp}: AR {ar:.1f} tok/s, c={c:.3f}, " + ", ".join(
                f"{v} {s:.2f}x" for v, s in r["speedup"].items()), flush=True)
    write_json("single_request", results)
    write_doc(results, a)
    plot(results, a)


def write_doc(res, a):
    m = res["machine"]
    lines = [
        "## Single request on the demo pair (issue 4)",
        "",
        f"Shipped pair (target ~23M, drafter ~1.5M parameters; trained on the Python stdlib, see "
        f"`src/infer/demo_models/`), {len(res['prompts'])} held-out prompts "
        f"({', '.join(str(p['tokens']) for p in res['prompts'])} tokens), {res['new_tokens']} new tokens each (EOS "
        f"ignored), {res['repeats']} interleaved repeats after a warm-up, per-prompt medians. {m['cpu']}, "
        f"{m['torch_threads']} threads, torch {m['torch']}, {m['date']}. tokens/s = all prompts' tokens / sum of "
        "median times. Our drafter scores " + (f"its {res['draft_vocab']} most frequent tokens plus the prompt's "
        "(draft vocabulary, lossless; `full vocab` rows score all 8,192)" if res.get("draft_vocab") else
        "the full vocabulary") + "; Hugging Face's always scores all. alpha = accepted / judged drafts (ours); "
        "c = one drafter step / one target step, both timed alike in our runtime (forward, head, argmax; the "
        "full-vocabulary c is in brackets); predicted = Leviathan's (1 - a^(K+1)) / ((1 - a)(Kc + 1)), which takes a "
        "(K+1)-token verify to cost one target step. v = what that verify measures in target steps; 'predicted at v' "
        "puts it in the formula ((1 - a^(K+1)) / ((1 - a)(Kc + v))). The formula covers decoding only, so the "
        "measured speedup is given twice: end-to-end (tokens/s with the prefill) and decode phase (from the first "
        "token to the last, as each Request stamps them).",
        "",
    ]
    for r in res["configs"]:
        tps, ar, hf_ar = r["tokens_per_s"], r["tokens_per_s"]["ours AR"], r["tokens_per_s"]["HF generate"]
        best_k = max((v for v in r["speedup"] if v.startswith("ours spec")), key=lambda v: r["speedup"][v])
        best_hf = max((v for v in tps if v.startswith("HF assisted")), key=lambda v: tps[v])
        label = r["dtype"] if "+" not in r["dtype"] else "target {} + drafter {}".format(*r["dtype"].split("+"))
        c_full = f" [{r['c_full_vocab']:.3f}]" if r.get("c_full_vocab") not in (None, r["c"]) else ""
        lines += [f"### {label}, temperature {r['temperature']:g} (c = {r['c']:.3f}{c_full}; target step "
                  f"{r['target_step_ms']:.2f} ms)", "",
                  "| variant | tokens/s | vs ours AR | vs HF generate | alpha | predicted | measured / predicted | "
                  "decode phase vs ours AR | decode / predicted | v | predicted at v | decode / predicted at v |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for v, s in tps.items():
            acc = r["acceptance"].get(v, {})
            pred, pred_v, dsp = r["predicted"].get(v), r["predicted_v"].get(v), r["decode_speedup"].get(v)
            k = v.split("K=")[1].split(",")[0] if pred else None
            cells = [v, f"{s:.1f}", f"{s / ar:.2f}x", f"{s / hf_ar:.2f}x",
                     f"{acc['alpha']:.2f}" if acc else "", f"{pred:.2f}x" if pred else "",
                     f"{s / ar / pred:.0%}" if pred else "", f"{dsp:.2f}x" if dsp else "",
                     f"{dsp / pred:.0%}" if pred else "", f"{r['verify_cost'][k]:.2f}" if pred else "",
                     f"{pred_v:.2f}x" if pred else "", f"{dsp / pred_v:.0%}" if pred else ""]
            lines.append("| " + " | ".join(cells) + " |")
        pb, pvb = r["predicted"][best_k], r["predicted_v"][best_k]
        lines += ["", f"Best ours: **{best_k}** at {r['speedup'][best_k]:.2f}x our AR end-to-end "
                      f"({r['speedup'][best_k] / pb:.0%} of the predicted {pb:.2f}x), {r['decode_speedup'][best_k]:.2f}x in "
                      f"the decode phase ({r['decode_speedup'][best_k] / pb:.0%}; {r['decode_speedup'][best_k] / pvb:.0%} "
                      f"of {pvb:.2f}x at the measured v); vs best HF assisted "
                      f"({best_hf}, {tps[best_hf]:.1f} tok/s): **{tps[best_k] / tps[best_hf]:.2f}x**. Ours AR vs HF "
                      f"generate: {ar / hf_ar:.2f}x."]
        if r["greedy_identical_to_ours_AR"] is not None:
            lines.append(f"Greedy outputs identical to ours AR for every speculative variant: "
                         f"{all(r['greedy_identical_to_ours_AR'].values())}; HF generate identical: {r['HF_generate_identical']}.")
        lines += ["", f"| prompt | tokens | acceptance ({best_k}) | repeated 4-grams in output |", "|---|---:|---:|---:|"]
        for p, pp in zip(res["prompts"], r["per_prompt"]):
            lines.append(f"| {p['module']} | {pp['prompt_tokens']} | {pp['acceptance'][best_k]:.2f} | "
                         f"{pp['ar_repeated_4gram_share']:.2f} |")
        lines.append("")
    lines += ["![speedup vs K](single_request_speedup.png)", "", "Reproduce: `python benchmarks/single_request.py`."]
    update_doc_section("single_request", "\n".join(lines))


def plot(res, a):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    cfgs = res["configs"]
    fig, axes = plt.subplots(1, len(cfgs), figsize=(5 * len(cfgs), 4), squeeze=False)
    for ax, r in zip(axes[0], cfgs):
        ks = a.ks
        ax.plot(ks, [r["speedup"][f"ours spec K={k}"] for k in ks], "o-", label="ours, measured")
        ax.plot(ks, [r["decode_speedup"][f"ours spec K={k}"] for k in ks], "o:", label="ours, decode phase")
        ax.plot(ks, [r["predicted"][f"ours spec K={k}"] for k in ks], "--", label="ours, Leviathan predicted")
        ax.plot(ks, [r["predicted_v"][f"ours spec K={k}"] for k in ks], "-.", label="predicted at measured verify cost")
        ax.plot(HF_CONST_KS, [r["hf_speedup"][f"HF assisted K={k}"] for k in HF_CONST_KS], "s-",
                label="HF assisted (vs HF generate)")
        ax.axhline(r["speedup"]["ours EGAG"], color="g", ls=":", label="ours EGAG")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"{r['dtype']}, T={r['temperature']:g}")
        ax.set_xlabel("K (draft tokens per round)")
        ax.set_ylabel("speedup vs own autoregressive")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = ROOT / "docs" / "single_request_speedup.png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main()
