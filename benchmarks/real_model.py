"""SmolLM2-135M-Instruct, one request, plain decoding: infer (float32 / bfloat16 / int8 / q8_0 / q4_0 / q4_1, compiled) against
transformers `generate` on the same dequantized weights and llama.cpp's `llama-bench` at F32 / BF16 / Q8_0 / Q4_1,
all interleaved in one run (A B C ... A B C ...), medians with quartiles.

Also: this machine's memory bandwidth (best of N reads of a 1 GiB tensor), the bytes of weights each variant reads
per token, hence its physical ceiling (bandwidth / bytes) and its share of it; and the quality of each quantization
(greedy agreement with float32 over 256 tokens, perplexity on held-out text).

llama.cpp is never built or installed by this script (nor by the package or the tests). To include it:
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON
    cmake --build build --target llama-bench -j 2                                   # ~20 min on 2 cores
    python -c "from infer.model import load_model, save_model; from infer.demo import real_model_path as p; \
               from transformers import AutoTokenizer; save_model(load_model(p()), 'smollm2-hf', dtype='float32'); \
               AutoTokenizer.from_pretrained(str(p().parent), gguf_file=p().name).save_pretrained('smollm2-hf')"
    pip install sentencepiece gguf        # what convert_hf_to_gguf.py imports (run it with PYTHONPATH=gguf-py)
    for t in f32 bf16 q8_0; do python convert_hf_to_gguf.py smollm2-hf --outtype $t --outfile smollm2-$t.gguf; done
then: python benchmarks/real_model.py --llama-bench build/bin/llama-bench --gguf-dir DIR_WITH_THE_THREE_FILES

    python benchmarks/real_model.py [--repeats 5] [--new-tokens 128] [--llama-bench PATH --gguf-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, update_doc_section, write_json  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.demo import real_model_path  # noqa: E402

PROMPTS = {
    "chat": [{"role": "user", "content": "Explain how a hash table works and when to use one."}],
    "code": "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
}
OURS = {  # name -> LLM settings
    "infer float32": dict(dtype="float32"),
    "infer bfloat16": dict(dtype="bfloat16"),
    "infer int8": dict(dtype="bfloat16", quantization="int8"),
    "infer q8_0": dict(dtype="bfloat16", quantization="q8_0"),
    "infer q4_0": dict(dtype="bfloat16", quantization="q4_0"),
    "infer q4_1": dict(dtype="bfloat16", quantization="q4_1"),
}
LLAMA_FILES = {"llama.cpp F32": "smollm2-f32.gguf", "llama.cpp BF16": "smollm2-bf16.gguf",
               "llama.cpp Q8_0": "smollm2-q8_0.gguf", "llama.cpp Q4_1": None}  # None: the shipped file
SAME_PRECISION = {"infer float32": "llama.cpp F32", "infer bfloat16": "llama.cpp BF16",
                  "infer int8": "llama.cpp Q8_0", "infer q8_0": "llama.cpp Q8_0", "infer q4_0": "llama.cpp Q4_1",
                  "infer q4_1": "llama.cpp Q4_1"}


def bandwidth_gbs(repeats: int = 7) -> float:
    """Best of N full reads of a 1 GiB float32 tensor (a sum: read-bound)."""
    x = torch.ones(2**28)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every weight, except the embedding table when a separate head exists (a lookup
    reads one row); with a tied head the table is the head and is read in full."""
    sd = model.state_dict()
    return sum(t.nbytes for n, t in sd.items() if n != "embed_tokens.weight" or model.lm_head is None)


def gguf_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def llama_quality(binary: str, paths: dict[str, Path], text: str, threads: int) -> dict[str, dict]:
    """llama.cpp's own perplexity of each file on the held-out text (llama-perplexity: windows of 256 tokens, the
    second half of each scored), and its delta against its F32 file: llama.cpp's quantization error measured the way
    llama.cpp measures it, to set beside ours."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    out = {}
    for name, p in paths.items():
        run = subprocess.run([binary, "-m", str(p), "-f", f.name, "-c", "256", "-t", str(threads)],
                             capture_output=True, text=True)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
        if m:
            out[name] = {"perplexity": float(m.group(1))}
    base = out.get("llama.cpp F32", {}).get("perplexity")
    for q in out.values():
        q["perplexity_delta_pct"] = 100 * (q["perplexity"] / base - 1) if base else float("nan")
    return out


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]  # noqa: E731
    return q(0.25), q(0.5), q(0.75)


def held_out_text() -> str:
    """Prose and code the model was not tuned on here: docstrings of a few standard-library modules."""
    import argparse as m1
    import collections as m2
    import json as m3
    import textwrap as m4

    return "\n\n".join(m.__doc__ for m in (m3, m2, m1, m4))


@torch.inference_mode()
def perplexity(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    logits = model.compute_logits(model(x))[0, :-1]  # no KV cache: one eager causal pass
    return math.exp(torch.nn.functional.cross_entropy(logits, x[0, 1:]).item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=None, help="path of a llama-bench binary (built by you, see above)")
    ap.add_argument("--gguf-dir", default=None, help="directory with smollm2-{f32,bf16,q8_0}.gguf")
    ap.add_argument("--llama-perplexity", default=None, help="path of a llama-perplexity binary: the same held-out "
                    "text through llama.cpp's files, for its quantizations' perplexity deltas")
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = real_model_path()
    t0 = time.perf_counter()
    # one request: only the one-row decode step is compiled (max_batch_size=1, no speculation)
    llms = {name: LLM(path, compile=True, compile_in_background=False, max_batch_size=1, **kw)
            for name, kw in OURS.items()}
    print(f"loaded our variants in {time.perf_counter() - t0:.1f}s", flush=True)
    tok = next(iter(llms.values())).tokenizer
    prompts = {"chat": tok.apply_chat_template(PROMPTS["chat"]), "code": tok.encode(PROMPTS["code"])}
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)

    def ours(llm, ids):
        def run():
            (r,) = llm.make_requests([ids], params)
            llm.engine.run([r])
            # decode phase: first token to last (prefill excluded, as llama-bench's tg measures)
            return (len(r.output_ids) - 1) / (r.finish_time - r.first_token_time)
        return run

    fns = {}
    t0 = time.perf_counter()
    for name, llm in llms.items():
        for p, ids in prompts.items():
            ours(llm, ids)()  # warm-up: compiles every step shape once
    print(f"compiled and warmed up in {time.perf_counter() - t0:.1f}s", flush=True)
    for name, llm in llms.items():
        fns[name] = [ours(llm, ids) for ids in prompts.values()]

    hf = {}
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        for dt in ("float32", "bfloat16"):
            m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dt))
            hf[f"transformers {dt}"] = m.eval()

        def hf_run(m, ids):
            def run():
                x = torch.tensor([ids])
                t = time.perf_counter()
                with torch.inference_mode():
                    m.generate(x, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False)
                return a.new_tokens / (time.perf_counter() - t)  # end to end (prefill included)
            return run

        for name, m in hf.items():
            hf_run(m, prompts["chat"])()
            fns[name] = [hf_run(m, ids) for ids in prompts.values()]

    llama_version, llama_paths = None, {}
    if a.llama_bench:
        for name, f in LLAMA_FILES.items():
            p = path if f is None else Path(a.gguf_dir or ".") / f
            if p.is_file():
                llama_paths[name] = p

        def llama_run(p):
            def run():
                nonlocal llama_version
                out = subprocess.run([a.llama_bench, "-m", str(p), "-p", "0", "-n", str(a.new_tokens), "-t",
                                      str(a.threads), "-r", "1", "-o", "json"], capture_output=True, text=True,
                                     check=True).stdout
                rec = json.loads(out)[0]
                llama_version = f"{rec.get('build_commit')} ({rec.get('build_number')})"
                return rec["avg_ts"]
            return run

        for name, p in llama_paths.items():
            fns[name] = [llama_run(p)]

    # interleaved rounds: every variant (and prompt) once per round
    rates = {name: [] for name in fns}
    for r in range(a.repeats):
        for name, runs in fns.items():
            for run in runs:
                rates[name].append(run())
        print(f"round {r + 1}/{a.repeats}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in fns), flush=True)

    bw = bandwidth_gbs()
    nbytes = {name: weight_bytes(llm.model) for name, llm in llms.items()}
    nbytes.update({name: weight_bytes(llms["infer " + name.split()[1]].model) for name in hf})
    nbytes.update({name: gguf_bytes(p) for name, p in llama_paths.items()})

    # quality: greedy agreement with float32 over 256 tokens; perplexity on held-out text
    ref_model = llms["infer float32"]
    gparams = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    ref = ref_model.generate([prompts["chat"]], gparams)[0].token_ids
    text_ids = tok.encode(held_out_text())[:1024]
    quality = {}
    for name, llm in llms.items():
        out = ref if llm is ref_model else llm.generate([prompts["chat"]], gparams)[0].token_ids
        prefix = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), len(ref))
        quality[name] = {"same_prefix": prefix, "same_positions": sum(x == y for x, y in zip(out, ref)) / len(ref),
                         "perplexity": perplexity(llm.model, text_ids)}
    base_ppl = quality["infer float32"]["perplexity"]
    for q in quality.values():
        q["perplexity_delta_pct"] = 100 * (q["perplexity"] / base_ppl - 1)
    if a.llama_perplexity and llama_paths:
        quality.update(llama_quality(a.llama_perplexity, llama_paths, held_out_text(), a.threads))

    rows = []
    for name, xs in rates.items():
        q1, med, q3 = quartiles(xs)
        ceiling = bw * 1e9 / nbytes[name]
        rows.append({"variant": name, "tok_s_median": med, "tok_s_q1": q1, "tok_s_q3": q3, "samples": len(xs),
                     "weight_mb_per_token": nbytes[name] / 1e6, "ceiling_tok_s": ceiling, "share_of_ceiling": med / ceiling})
    by = {r["variant"]: r for r in rows}
    ratios = {o: by[o]["tok_s_median"] / by[l]["tok_s_median"] for o, l in SAME_PRECISION.items() if l in by}
    res = {"benchmark": "real_model", "machine": machine(), "model": f"SmolLM2-135M-Instruct ({path.name})",
           "new_tokens": a.new_tokens, "threads": a.threads, "repeats": a.repeats, "prompts": PROMPTS,
           "bandwidth_gbs": bw, "llama_cpp_build": llama_version, "rows": rows, "vs_llama_cpp": ratios,
           "quality": quality,
           "notes": "ours: decode phase (first token to last) through LLM/engine, compiled; transformers: end to "
                    "end generate; llama.cpp: llama-bench tg (-p 0 -n N -t threads)"}
    write_json("real_model", res)
    md = ["## SmolLM2-135M-Instruct: plain decoding vs llama.cpp and transformers (issue 14)", "",
          f"SmolLM2-135M-Instruct ({path.name}), one request, {a.new_tokens} greedy tokens, {a.threads} threads, "
          f"{machine()['cpu']}, torch {torch.__version__}, llama.cpp {llama_version or 'not run'}; "
          f"{a.repeats} interleaved rounds x {len(prompts)} prompts (ours, transformers), medians [q1-q3]. "
          f"Memory bandwidth measured here: {bw:.1f} GB/s. `python benchmarks/real_model.py`.", "",
          "| runtime, precision | tok/s | MB read per token | ceiling tok/s | share of ceiling | vs llama.cpp same precision |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = ratios.get(r["variant"])
        md.append(f"| {r['variant']} | {r['tok_s_median']:.1f} [{r['tok_s_q1']:.1f}-{r['tok_s_q3']:.1f}] | "
                  f"{r['weight_mb_per_token']:.0f} | {r['ceiling_tok_s']:.0f} | {r['share_of_ceiling']:.0%} | "
                  f"{f'{ratio:.2f}x' if ratio else ''} |")
    md += ["", "Quality against float32 (greedy, chat prompt, 256 tokens; perplexity on 1,024 tokens of standard-library "
           "docstrings):", "", "| variant | same tokens before the first difference | same tokens by position | "
           "perplexity | vs float32 |", "|---|---|---|---|---|"]
    for name, q in quality.items():
        if "same_prefix" in q:
            md.append(f"| {name} | {q['same_prefix']} / 256 | {q['same_positions']:.0%} | {q['perplexity']:.3f} | "
                      f"{q['perplexity_delta_pct']:+.2f}% |")
        else:  # llama.cpp's files through llama-perplexity (its own windows), against its own F32 file
            md.append(f"| {name} (llama-perplexity) | | | {q['perplexity']:.3f} | {q['perplexity_delta_pct']:+.2f}% "
                      "vs its F32 |")
    update_doc_section("real_model", "\n".join(md))
    plot(rows, ROOT / "docs" / "real_model.png")
    print("\n".join(md))


def plot(rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["tok_s_median"] for r in rows],
            xerr=[[r["tok_s_median"] - r["tok_s_q1"] for r in rows], [r["tok_s_q3"] - r["tok_s_median"] for r in rows]],
            color=["tab:blue" if n.startswith("infer") else "tab:gray" if n.startswith("trans") else "tab:orange"
                   for n in names])
    ax.scatter([r["ceiling_tok_s"] for r in rows], names, marker="|", s=300, color="black", label="bandwidth ceiling")
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (decode, one request)")
    ax.set_title("SmolLM2-135M-Instruct on this CPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
