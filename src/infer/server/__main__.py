"""``python -m infer.server`` / ``infer serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
import threading

import uvicorn

from ..cli_args import (_text_or_file, add_dataclass_args, add_lora_modules_arg, add_model_args, add_spec_args,
                        config_kwargs, lora_modules)
from ..engine.config import EngineConfig

ENGINE_FIELDS = ("kv_cache_backend", "block_size", "num_kv_blocks", "enable_prefix_caching", "max_batch_size",
                 "max_seq_len", "max_num_batched_tokens", "max_waiting_requests", "scheduling_policy",
                 "spec_max_batch_size", "seed", "enable_lora", "max_loras", "max_lora_rank",
                 "max_cpu_loras")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_lora_modules_arg(p)
    add_spec_args(p)
    # a server bounds its queue by default (the library's engine does not): more waiting requests get 503
    add_dataclass_args(p, EngineConfig, ENGINE_FIELDS, max_waiting_requests=256)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"),
                   help="read the calls a model writes in its own format, so that tool_choice 'auto' (the default "
                        "with tools) is served: hermes (<tool_call>...</tool_call>) or llama3_json (Llama 3.1-3.3); "
                        "the chat template must show the tools (SmolLM2's does not). Without it 'auto' is refused; "
                        "'required' and a named function need none")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, accepted as it is: --tool-call-parser is what serves 'auto' (and this needs it)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (inline, or a file holding it) used instead of the checkpoint's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (vLLM's flag); without it such a request is refused: "
                        "a template is code the server runs (sandboxed, but free to loop)")
    p.add_argument("--pooling", default="last", choices=("last", "mean"),
                   help="how /v1/embeddings pools an input's final states into one vector (llama.cpp's flag): the "
                        "last token's (default, as vLLM embeds with a generative model) or their mean")
    p.add_argument("--no-slots", dest="slots", action="store_false",
                   help="do not serve GET /slots (llama-server's flag): each slot's request state and sampling "
                        "parameters, no text; served by default")
    p.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas behind Ray Serve's HTTP proxy (optional: pip install -e '.[ray]'); "
                        "default: one engine in this process, no Ray")
    p.add_argument("--max-replicas", type=int, default=None,
                   help="with --replicas: let Ray Serve autoscale up to this many replicas on requests in flight")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica (default: 1)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, seconds requests in flight may take to finish; then they are aborted "
                        "(each stream ends with a final event, finish_reason 'abort') and the server exits "
                        "(default: 10)")


def engine_config(a) -> EngineConfig:
    if not 0 < a.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {a.port}")
    if not a.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {a.shutdown_timeout}")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes | llama3_json): the model's call "
                         "format, which tool_choice 'auto' is read with")
    from ..demo import with_serve_defaults

    # SmolLM2's shipped GGUF: its Q4_1 blocks on the integer kernel and its best drafter, unless asked otherwise
    kw = config_kwargs(a, EngineConfig)
    if "lora_modules" in kw:
        kw["lora_modules"] = lora_modules(kw["lora_modules"])
    return EngineConfig(**with_serve_defaults(kw))


def chat_template(a) -> str | None:
    """--chat-template's text (inline, or the file it names)."""
    return None if a.chat_template is None else _text_or_file(a.chat_template)


def check_listen(host: str, port: int) -> None:
    """That this machine can listen on host:port (a test bind, closed at once; uvicorn binds with SO_REUSEADDR as this
    does) -> ValueError naming the address and the reason: a name that does not resolve, an address not on this
    machine, a port in use."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address to listen on ({e.strerror})") from e
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def describe(cfg: EngineConfig) -> str:
    """The start-up line's account of what runs: the precision where one was set, the speculation."""
    text = f" ({cfg.dtype}, {cfg.quantization})" if cfg.quantization is not None else ""
    if cfg.use_speculative_decoding:
        cap = "" if cfg.spec_max_batch_size is None else f", while at most {cfg.spec_max_batch_size} requests decode"
        text += f", speculative ({cfg.proposer}, K={cfg.spec_length}{cap})"
    if cfg.lora_modules:
        text += f", LoRA adapters {', '.join(cfg.lora_modules)}"
    if cfg.enable_lora:
        text += f", {cfg.max_loras} LoRA slot(s) of rank {cfg.max_lora_rank}" + (
            f", {cfg.max_cpu_loras} adapters loaded at most" if cfg.max_cpu_loras > cfg.max_loras else "") + \
            " (/v1/load_lora_adapter)"
    return text


def serve(a) -> int:
    from ..engine.async_engine import AsyncEngine
    from .app import build_app

    cfg = engine_config(a)  # every bad combination fails here, before any model is loaded
    if a.replicas is not None or a.max_replicas is not None:
        from .replicas import serve_replicas

        if a.replicas is None or a.replicas < 1:
            raise ValueError(f"--replicas must be an integer >= 1, got {a.replicas}")
        if not a.replica_cpus > 0:
            raise ValueError(f"--replica-cpus must be > 0, got {a.replica_cpus}")
        if cfg.enable_lora:
            raise ValueError("--enable-lora with --replicas: a /v1/load_lora_adapter call would reach one replica "
                             "only; name the adapters at start with --lora-modules")
        return serve_replicas(a, cfg)
    check_listen(a.host, a.port)  # before the model loads: uvicorn's own failure comes after it, without the address
    engine = AsyncEngine(cfg)
    try:
        app = build_app(engine, a.served_model_name or str(a.model), a.api_key, a.max_body_bytes,
                        tool_parser=a.tool_call_parser, chat_template=chat_template(a),
                        trust_request_chat_template=a.trust_request_chat_template, pooling=a.pooling,
                        slots=a.slots)
        print(f"infer: serving {a.model}{describe(cfg)} on http://{a.host}:{a.port}", file=sys.stderr)
        config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning",
                                timeout_graceful_shutdown=a.shutdown_timeout + 1.0)  # the aborted streams' last events
        GracefulServer(config, engine, a.shutdown_timeout).run()
    finally:
        engine.shutdown()
    return 0


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a deadline on shutdown: at SIGTERM/SIGINT it stops accepting connections and lets the
    requests in flight finish for ``grace`` seconds; then it aborts what is left (every stream gets its final event
    and [DONE], every non-streaming request its partial answer) and exits. A second SIGINT still exits at once."""

    def __init__(self, config: uvicorn.Config, engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace, self.engine.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


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
