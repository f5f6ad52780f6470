"""``python -m infer.server`` / ``infer serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

from ..cli import add_draft_args, add_model_args


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_draft_args(p)
    p.add_argument("--speculative-decoding", action="store_true", help="speculate (needs --draft-model)")
    p.add_argument("--kv-cache-backend", default="paged", help="paged | contiguous")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-waiting-requests", type=int, default=256, help="queue bound; more gets 503")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=None)


def engine_config(a):
    from ..engine import EngineConfig

    if a.speculative_decoding and a.draft_model is None:
        raise ValueError("--speculative-decoding needs --draft-model")
    if not 0 < a.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {a.port}")
    return EngineConfig(model=a.model, draft_model=a.draft_model, spec_length=a.spec_length,
                        draft_vocab_size=a.draft_vocab_size, kv_cache_backend=a.kv_cache_backend,
                        block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
                        enable_prefix_caching=a.enable_prefix_caching, max_batch_size=a.max_batch_size,
                        max_seq_len=a.max_seq_len, max_num_batched_tokens=a.max_num_batched_tokens,
                        max_waiting_requests=a.max_waiting_requests, dtype=a.dtype, device=a.device, seed=a.seed,
                        quantization=a.quantization, compile=a.compile)


def serve(a) -> int:
    import uvicorn

    from ..engine.async_engine import AsyncEngine
    from .app import build_app

    cfg = engine_config(a)  # every bad combination fails here, before any model is loaded
    engine = AsyncEngine(cfg)
    app = build_app(engine, a.served_model_name or str(a.model), a.api_key, a.max_body_bytes)
    spec = f", speculative K={cfg.spec_length} with {a.draft_model}" if cfg.use_speculative_decoding else ""
    print(f"infer: serving {a.model}{spec} on http://{a.host}:{a.port}", file=sys.stderr)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infer.server", description="OpenAI-compatible server")
    add_serve_args(p)
    a = p.parse_args(argv)
    try:
        return serve(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"infer serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
