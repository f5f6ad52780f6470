"""The ``infer`` command line."""

from __future__ import annotations

import argparse
import sys
import time

from .cli_args import (add_dataclass_args, add_model_args, add_sampling_args, add_spec_args, config_kwargs,
                       sampling_params)
from .engine.config import EngineConfig


def cmd_generate(a) -> int:
    from .demo import CHAT_ENGINE, with_real_model_defaults
    from .llm import LLM

    params = sampling_params(a)  # validate before the (slower) model load
    # one prompt: one KV slot; SmolLM2's shipped GGUF runs as `infer chat` runs it unless a flag says otherwise
    cfg = {**CHAT_ENGINE, **with_real_model_defaults(config_kwargs(a, EngineConfig))}
    if a.debug and not EngineConfig(**cfg).use_speculative_decoding:
        raise ValueError("--debug shows speculative rounds: it needs --draft-model (or --speculative-decoding)")
    t0 = time.perf_counter()
    llm = LLM(**cfg)
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

    from .demo import CHAT_ENGINE, with_real_model_defaults

    params = sampling_params(a)
    # SmolLM2's shipped GGUF: its best drafter, and its own Q4_1 blocks on the integer kernel, unless asked otherwise
    llm = LLM(**CHAT_ENGINE, **with_real_model_defaults(config_kwargs(a, EngineConfig)))
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

    run_demo(max_tokens=a.max_tokens, num_prompts=a.prompts, real=not a.no_real,
             **config_kwargs(a, EngineConfig, ("spec_length", "dtype", "quantization", "draft_vocab_size",
                                                        "proposer")))
    return 0


def cmd_serve(a) -> int:
    from .server.__main__ import serve

    return serve(a)


def cmd_bench_serve(a) -> int:
    from .bench_serve import run_bench

    return 0 if run_bench(a)["ok"] else 1  # a load of which nothing succeeded is a failure (each reason printed)


def build_parser() -> argparse.ArgumentParser:
    from .demo import PAIR_SETTINGS

    parser = argparse.ArgumentParser(prog="infer", description="LLM inference with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt")
    add_model_args(g)
    add_sampling_args(g, max_tokens=64)  # a command line wants more than the library's 16 tokens
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add_spec_args(g)
    g.add_argument("--debug", action="store_true", help="show every speculative round (accepted/rejected/bonus)")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive streaming chat with the model's chat template")
    add_model_args(c)
    add_sampling_args(c, max_tokens=512, temperature=0.7)  # a conversation: long replies, some variety
    add_spec_args(c)
    c.add_argument("--system", default=None, help="a system message (default: the template's own, if any)")
    c.set_defaults(func=cmd_chat)
    d = sub.add_parser("demo", help="a real chat with SmolLM2-135M-Instruct (if installed), then speculative "
                                    "decoding on the shipped demo pair vs autoregressive")
    d.add_argument("--no-real", action="store_true", help="skip the SmolLM2 chat; only the shipped pair")
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--prompts", type=int, default=3)
    add_dataclass_args(d, EngineConfig, ("dtype", "quantization", "proposer", "spec_length", "draft_vocab_size"),
                       quantization=PAIR_SETTINGS["quantization"])  # the pair's (none: its bfloat16 weights)
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
    from . import progress

    progress.enable()  # start-up stages on stderr (the library itself stays silent)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:  # bad input: one clear line, no traceback
        print(f"infer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
