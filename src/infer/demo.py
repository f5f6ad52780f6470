"""The shipped demo pair (trained by scripts/train_demo_pair.py) and `infer demo`.

A ~23M-parameter Llama target and a ~1.5M-parameter drafter distilled from it, trained on the Python standard
library's source. A demo, not a language model: it completes Python-looking code.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"


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


def run_demo(spec_length: int = 2, max_tokens: int = 128, num_prompts: int = 3, dtype: str = "float32",
             draft_vocab_size: int | None = 2048, out=sys.stdout) -> dict:
    import torch

    from .generate import autoregressive_generate
    from .llm import LLM
    from .sampling import SamplingParams
    from .spec.debug import RoundPrinter
    from .spec.speculative import speculative_generate

    t_start = time.perf_counter()
    target_dir, drafter_dir = demo_model_paths()
    vocab = f"drafter scores {draft_vocab_size} frequent tokens + the prompt's" if draft_vocab_size else "full vocab"
    print(f"infer demo: speculative decoding on the shipped pair ({DEMO_DIR}), K={spec_length}, greedy, {dtype}, "
          f"{vocab}, CPU threads {torch.get_num_threads()}", file=out)
    llm = LLM(target_dir, dtype=dtype, draft_model=drafter_dir, spec_length=spec_length,
              draft_vocab_size=draft_vocab_size or None)
    sizes = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (llm.model, llm.draft_model)]
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
    for p in prompts:
        ids = tok.encode(p["prompt"])
        # warm-up once per prompt so neither side pays first-call costs, then time each once
        autoregressive_generate(llm.model, ids, params, llm.eos_token_ids)
        t0 = time.perf_counter()
        ar = autoregressive_generate(llm.model, ids, params, llm.eos_token_ids)
        t_ar = time.perf_counter() - t0
        t0 = time.perf_counter()
        sp, _ = speculative_generate(llm.model, llm.draft_model, ids, params, gamma=spec_length,
                                     eos_token_ids=llm.eos_token_ids, draft_vocab=llm.draft_vocab)
        t_sp = time.perf_counter() - t0
        rows.append({"module": p["module"], "tokens": len(sp.output_ids),
                     "ar_tok_s": len(ar.output_ids) / t_ar, "spec_tok_s": len(sp.output_ids) / t_sp,
                     "acceptance": sp.num_accepted_tokens / max(1, sp.num_draft_tokens),
                     "identical": ar.output_ids == sp.output_ids})
    print(f"{'held-out module':34s} {'tokens':>6s} {'AR tok/s':>9s} {'spec tok/s':>10s} {'speedup':>8s} "
          f"{'accept':>7s}  same output", file=out)
    for r in rows:
        print(f"{r['module'][:34]:34s} {r['tokens']:6d} {r['ar_tok_s']:9.1f} {r['spec_tok_s']:10.1f} "
              f"{r['spec_tok_s'] / r['ar_tok_s']:7.2f}x {r['acceptance']:7.2f}  {r['identical']}", file=out)
    speedups = sorted(r["spec_tok_s"] / r["ar_tok_s"] for r in rows)
    print(f"\nmedian speedup {speedups[len(speedups) // 2]:.2f}x; greedy outputs identical with and without "
          f"speculation: {all(r['identical'] for r in rows)}. Full comparison with Hugging Face: "
          "benchmarks/single_request.py", file=out)
    return {"rows": rows}
