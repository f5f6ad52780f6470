"""``infer serve --replicas N``: N engine replicas behind Ray Serve's HTTP proxy, one endpoint, the same OpenAI routes.

Optional (``pip install -e ".[ray]"``). Each replica is a Ray actor holding one AsyncEngine and the very app
``infer serve`` runs alone (build_app): the routes, the errors, the metrics and the playground are the same code.
Ray Serve's proxy routes each request to the replica with fewer requests in flight (power of two choices over
``max_ongoing_requests``); requests beyond every replica's limit wait in Ray's queue (``max_queued_requests``, then
503, as the single server's ``--max-waiting-requests``).

Scaling on queue length: with ``--max-replicas M`` (> N) Ray Serve's autoscaler keeps between N and M replicas,
aiming at ``max_batch_size`` requests in flight per replica: beyond a full batch a replica only queues, so another
replica pays. Every response carries ``x-infer-replica`` (the replica's id), so a client or a test sees who served it.
A replica whose engine loop has died (e.g. a lost tensor-parallel worker) fails Ray's health check and is replaced.

Ray runs locally (a fresh instance on this machine) unless ``RAY_ADDRESS`` names a cluster to join.
"""

from __future__ import annotations

import sys
import threading

REPLICA_HEADER = "x-infer-replica"


def _require_ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError("--replicas needs Ray Serve, an optional dependency: pip install -e \".[ray]\"") from e
    return ray, serve


def deployment(cfg, served_model_name: str, api_key: str | None, max_body_bytes: int, replicas: int,
               max_replicas: int | None = None, replica_cpus: float = 1.0, grace: float = 10.0,
               **app_options):
    """The Ray Serve application: an ``InferReplica`` deployment bound to the engine's config; ``app_options``:
    build_app's (tool_parser, chat_template, trust_request_chat_template, pooling, slots)."""
    _, serve = _require_ray()

    @serve.ingress()
    class InferReplica:
        """One replica: an AsyncEngine and build_app's OpenAI app, built when Ray starts the replica."""

        def __init__(self, cfg, served_model_name, api_key, max_body_bytes, app_options):
            self.args, self.options = (served_model_name, api_key, max_body_bytes), app_options
            self.cfg, self.engine = cfg, None

        def __serve_build_asgi_app__(self):
            from ..engine.async_engine import AsyncEngine
            from .app import build_app

            replica = serve.get_replica_context().replica_id.unique_id
            self.engine = AsyncEngine(self.cfg)
            return build_app(self.engine, *self.args, replica=replica, **self.options)

        def check_health(self):
            if self.engine is not None and self.engine.error is not None:
                raise RuntimeError(f"engine loop stopped: {self.engine.error}")

        def __del__(self):
            if self.engine is not None:
                self.engine.shutdown()

    opts = {"ray_actor_options": {"num_cpus": replica_cpus},
            "max_ongoing_requests": 2 * cfg.max_batch_size,  # a running batch and as many ready to join it
            "max_queued_requests": cfg.max_waiting_requests or -1,
            "graceful_shutdown_timeout_s": grace}
    if max_replicas is not None and max_replicas > replicas:
        opts["autoscaling_config"] = {"min_replicas": replicas, "max_replicas": max_replicas,
                                      "target_ongoing_requests": cfg.max_batch_size}
    else:
        opts["num_replicas"] = replicas
    return serve.deployment(InferReplica, name="infer", **opts).bind(cfg, served_model_name, api_key, max_body_bytes,
                                                                     app_options)


def serve_replicas(a, cfg) -> int:
    """Start (or join) Ray, run the deployment on ``a.host:a.port``, block until SIGTERM/SIGINT, then shut down."""
    import signal

    from .__main__ import chat_template

    ray, serve = _require_ray()
    if a.max_replicas is not None and a.max_replicas < a.replicas:
        raise ValueError(f"--max-replicas ({a.max_replicas}) must be >= --replicas ({a.replicas})")
    app = deployment(cfg, a.served_model_name or str(a.model), a.api_key, a.max_body_bytes, a.replicas,
                     a.max_replicas, a.replica_cpus, a.shutdown_timeout, tool_parser=a.tool_call_parser,
                     chat_template=chat_template(a), trust_request_chat_template=a.trust_request_chat_template,
                     pooling=a.pooling, slots=a.slots)
    ray.init(include_dashboard=False, logging_level="WARNING")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        quiet = {"log_level": "WARNING"}  # as the single server's uvicorn: no line per request
        serve.start(http_options={"host": a.host, "port": a.port}, logging_config=quiet)
        serve.run(app, name="infer", route_prefix="/", logging_config=quiet)
        n = f"{a.replicas}..{a.max_replicas}" if a.max_replicas and a.max_replicas > a.replicas else a.replicas
        print(f"infer: serving {a.model} on http://{a.host}:{a.port} with {n} replicas (Ray Serve)", file=sys.stderr)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
