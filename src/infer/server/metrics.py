"""Prometheus metrics: latency histograms observed by the server, engine counters read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads Engine.stats and queue/KV state on every scrape (no double bookkeeping)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        eng = self.engine.engine
        st = eng.stats
        yield CounterMetricFamily("infer_prompt_tokens", "Prompt tokens run through the target "
                                  "(recomputation after preemption included)", value=st.prompt_tokens)
        yield CounterMetricFamily("infer_generation_tokens", "Generated tokens", value=st.generation_tokens)
        yield CounterMetricFamily("infer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=st.prefix_cache_hit_tokens)
        yield CounterMetricFamily("infer_preemptions", "Requests preempted (KV pool dry)", value=st.num_preemptions)
        yield GaugeMetricFamily("infer_requests_running", "Requests holding KV slots", value=eng.num_running)
        yield GaugeMetricFamily("infer_requests_waiting", "Requests queued", value=eng.num_waiting)
        total = eng.initial_free_kv_tokens
        yield GaugeMetricFamily("infer_kv_cache_usage", "Share of KV token capacity in use (0-1)",
                                value=1.0 - eng.free_kv_tokens() / total if total else 0.0)
        yield CounterMetricFamily("infer_spec_drafts", "Speculation rounds (per request)", value=st.num_drafts)
        yield CounterMetricFamily("infer_spec_draft_tokens", "Drafted tokens", value=st.num_draft_tokens)
        yield CounterMetricFamily("infer_spec_accepted_tokens", "Accepted draft tokens", value=st.num_accepted_tokens)
        yield CounterMetricFamily("infer_spec_tree_rounds", "Speculation rounds that verified a token tree (per "
                                  "request)", value=st.tree_rounds)
        yield CounterMetricFamily("infer_spec_tree_nodes", "Draft nodes verified in token trees", value=st.tree_nodes)
        per_pos = CounterMetricFamily("infer_spec_accepted_tokens_per_position",
                                      "Rounds whose draft at this position was accepted", labels=["position"])
        for i, n in enumerate(st.accepted_per_position):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        if eng.loras.dynamic:  # vLLM's lora_requests_info: which adapters run, which wait for a slot
            info = GaugeMetricFamily("infer_lora_requests_info", "LoRA adapters of running and waiting requests",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(eng.config.max_loras), _adapters(eng.scheduler.running),
                             _adapters(eng.scheduler.waiting)], 1.0)
            yield info


def _adapters(queue) -> str:
    """The adapters the requests of ``queue`` name, sorted, comma-separated. The model thread changes the queue while a
    scrape reads it (a deque says so by raising): read again."""
    for _ in range(10):
        try:
            return ",".join(sorted({r.lora_name for r in list(queue) if r.lora_name is not None}))
        except RuntimeError:
            continue
    return ""


class ServerMetrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.requests = Counter("infer_requests", "Finished requests by status", ["status"], registry=self.registry)
        self.ttft = Histogram("infer_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("infer_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("infer_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS,
                             registry=self.registry)
        self.embedded_inputs = Counter("infer_embedded_inputs", "Inputs embedded (/v1/embeddings)",
                                       registry=self.registry)
        self.embedded_tokens = Counter("infer_embedded_tokens", "Tokens read by embeddings (/v1/embeddings; not in "
                                       "infer_prompt_tokens)", registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def embedded(self, inputs: int, tokens: int) -> None:
        self.embedded_inputs.inc(inputs)
        self.embedded_tokens.inc(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
