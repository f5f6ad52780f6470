"""The ``infer`` command line."""

from __future__ import annotations

import argparse
import sys
import time


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device, shared by ``infer generate`` and ``infer serve``."""
    p.add_argument("--model", required=True,
                   help="checkpoint: an HF directory, a .gguf file (or a directory holding one), or a hub id "
                        "already in the local HF cache")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the target (int8 per channel, int4 in groups of 32)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="torch.compile the decode/verify steps (default: auto, on for models >= 50M parameters)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager PyTorch only")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """The drafter flags shared by ``infer generate`` and ``infer serve``."""
    p.add_argument("--draft-model", default=None, help="drafter checkpoint: turns speculative decoding on")
    p.add_argument("--spec-length", type=int, default=5, help="K, draft tokens per round")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="drafter scores only its N most frequent tokens (needs draft_vocab.json beside the drafter)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _sampling_params(a):
    from .sampling import SamplingParams

    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repetition_penalty=a.repetition_penalty, max_tokens=a.max_tokens, stop=a.stop,
                          seed=a.seed, ignore_eos=a.ignore_eos)


def cmd_generate(a) -> int:
    from .llm import LLM

    params = _sampling_params(a)  # validate before the (slower) model load
    if a.debug and a.draft_model is None:
        raise ValueError("--debug shows speculative rounds: it needs --draft-model")
    t0 = time.perf_counter()
    llm = LLM(a.model, dtype=a.dtype, device=a.device, draft_model=a.draft_model, spec_length=a.spec_length,
              draft_vocab_size=a.draft_vocab_size, use_egag=a.egag, gamma_min=a.gamma_min, gamma_max=a.gamma_max,
              quantization=a.quantization, compile=a.compile)
    load_s = time.perf_counter() - t0
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, debug=a.debug)[0]
    dt = time.perf_counter() - t0
    if not a.chat:
        print(a.prompt, end="")
    print(out.text)
    n = len(out.token_ids)
    spec = ""
    if out.acceptance_rate is not None:
        spec = (f"; acceptance {out.acceptance_rate:.2f} ({out.num_accepted_tokens}/{out.num_draft_tokens}), "
                f"{out.mean_accepted_length:.2f} tokens per target forward")
    print(f"\n[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s; load {load_s:.2f}s; finish_reason={out.finish_reason}"
          f"{spec}]", file=sys.stderr)
    return 0


def cmd_chat(a) -> int:
    from .chat import run_chat
    from .llm import LLM

    params = _sampling_params(a)
    llm = LLM(a.model, dtype=a.dtype, device=a.device, draft_model=a.draft_model, spec_length=a.spec_length,
              draft_vocab_size=a.draft_vocab_size, quantization=a.quantization, compile=a.compile)
    return run_chat(llm, params, system=a.system)


def cmd_make_tiny(a) -> int:
    from .testing import SHAPES, make_tiny_llama, param_count

    if a.shape not in SHAPES:
        raise ValueError(f"unknown shape {a.shape!r}; one of {', '.join(SHAPES)}")
    path = make_tiny_llama(a.out_dir, a.shape, seed=a.seed)
    print(f"wrote a random {a.shape} Llama ({param_count(path):,} parameters) to {path}")
    return 0


def cmd_demo(a) -> int:
    from .demo import run_demo

    run_demo(spec_length=a.spec_length, max_tokens=a.max_tokens, num_prompts=a.prompts, dtype=a.dtype,
             draft_vocab_size=a.draft_vocab_size, real=not a.no_real)
    return 0


def cmd_serve(a) -> int:
    from .server.__main__ import serve

    return serve(a)


def cmd_bench_serve(a) -> int:
    from .bench_serve import run_bench

    run_bench(a)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description="LLM inference with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt")
    add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add_draft_args(g)
    g.add_argument("--egag", action="store_true", help="entropy-adaptive K within [--gamma-min, --gamma-max]")
    g.add_argument("--gamma-min", type=int, default=1)
    g.add_argument("--gamma-max", type=int, default=None)
    g.add_argument("--debug", action="store_true", help="show every speculative round (accepted/rejected/bonus)")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive streaming chat with the model's chat template")
    add_model_args(c)
    _add_sampling_args(c)
    add_draft_args(c)
    c.add_argument("--system", default=None, help="a system message (default: the template's own, if any)")
    c.set_defaults(func=cmd_chat, max_tokens=512, temperature=0.7)
    d = sub.add_parser("demo", help="a real chat with SmolLM2-135M-Instruct (if installed), then speculative "
                                    "decoding on the shipped demo pair vs autoregressive")
    d.add_argument("--no-real", action="store_true", help="skip the SmolLM2 chat; only the shipped pair")
    d.add_argument("--spec-length", type=int, default=2)
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--prompts", type=int, default=3)
    d.add_argument("--dtype", default="float32")
    d.add_argument("--draft-vocab-size", type=int, default=2048,
                   help="drafter scores its N most frequent tokens plus the prompt's (0: the full vocabulary)")
    d.set_defaults(func=cmd_demo)
    from .bench_serve import add_bench_args
    from .server.__main__ import add_serve_args

    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench-serve", help="bounded streaming load against a running server")
    add_bench_args(b)
    b.set_defaults(func=cmd_bench_serve)
    t = sub.add_parser("make-tiny", help="write a tiny random HF-format Llama checkpoint (for tests and trials)")
    t.add_argument("out_dir")
    t.add_argument("--shape", default="llama3", help="mha | gqa | llama3 | tied")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:  # bad input: one clear line, no traceback
        print(f"infer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
