"""Prometheus series of the HTTP server: request counts and latencies, time to first token, token rates,
the engine's queue, prefix-store reuse and the memory ledger's bytes per tier (checkpoints also per kind).

Every app gets its own `CollectorRegistry`, so several servers (or tests) in one process do not clash.
Request-level series are updated by the request handlers; engine-level series come from a snapshot the
engine thread takes when /metrics is scraped (`EngineCollector`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)

# prefix-store counters in the ledger -> (series name, help)
PREFIX_COUNTERS = {
    "lookups": ("jaxhybrid_prefix_lookups", "prompts looked up in the prefix store"),
    "hits": ("jaxhybrid_prefix_hits", "prompts that reused a cached prefix"),
    "hit_tokens": ("jaxhybrid_prefix_hit_tokens", "prompt tokens reused from the prefix store"),
    "recomputed_tokens": (
        "jaxhybrid_prefix_recomputed_tokens",
        "prompt tokens whose KV was cached but had to be recomputed (no state checkpoint at their end)",
    ),
    "evicted_blocks": ("jaxhybrid_prefix_evicted_blocks", "cached KV blocks evicted"),
    "demotions": ("jaxhybrid_prefix_demotions", "state checkpoints moved to a lower tier"),
    "dropped_checkpoints": ("jaxhybrid_prefix_dropped_checkpoints", "state checkpoints dropped"),
}


# speculative decoding's counters (Engine.speculation_stats) -> (series name, help)
SPECULATION_COUNTERS = {
    "windows": ("jaxhybrid_spec_decode_windows", "decode steps of a request that carried drafted tokens"),
    "drafted": ("jaxhybrid_spec_decode_draft_tokens", "drafted tokens verified"),
    "accepted": ("jaxhybrid_spec_decode_accepted_tokens", "drafted tokens accepted"),
}


class EngineCollector(Collector):
    """Engine series from the latest snapshot (set by the /metrics handler before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if not snap:
            return
        g = GaugeMetricFamily("jaxhybrid_requests_running", "requests holding a slot")
        g.add_metric([], snap["running"])
        yield g
        g = GaugeMetricFamily("jaxhybrid_requests_waiting", "requests waiting for a slot")
        g.add_metric([], snap["waiting"])
        yield g
        g = GaugeMetricFamily(
            "jaxhybrid_generation_tokens_per_second", "tokens generated per second over the last window"
        )
        g.add_metric([], snap["tokens_per_second"])
        yield g
        g = GaugeMetricFamily("jaxhybrid_engine_healthy", "1 while the engine loop runs, 0 after a failure")
        g.add_metric([], 1.0 if snap.get("healthy", True) else 0.0)
        yield g
        spec = snap.get("speculation", {})
        for key, (name, doc) in SPECULATION_COUNTERS.items():
            if key in spec:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], spec[key])
                yield c
        if "mean_accepted" in spec:
            g = GaugeMetricFamily(
                "jaxhybrid_spec_decode_mean_accepted_tokens", "accepted drafted tokens per verified window"
            )
            g.add_metric([], spec["mean_accepted"])
            yield g
        ledger = snap.get("ledger", {})
        for key, (name, doc) in PREFIX_COUNTERS.items():
            if key in ledger:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], ledger[key])
                yield c
        g = GaugeMetricFamily(
            "jaxhybrid_ledger_bytes",
            "bytes in the memory ledger by kind (live_kv, live_state, cached_kv, checkpoint) and tier",
            labels=["kind", "tier"],
        )
        for kind in ("live_kv", "live_state", "cached_kv"):
            g.add_metric([kind, "device"], ledger.get(f"{kind}_bytes", 0))
        for tier, nbytes in ledger.get("checkpoint_bytes", {}).items():
            g.add_metric(["checkpoint", tier], nbytes)
        yield g
        g = GaugeMetricFamily("jaxhybrid_checkpoints", "state checkpoints held, by tier", labels=["tier"])
        for tier, count in ledger.get("checkpoints", {}).items():
            g.add_metric([tier], count)
        yield g
        for name, key, doc in (
            ("jaxhybrid_checkpoint_bytes", "checkpoint_bytes_by_kind", "state checkpoint bytes"),
            ("jaxhybrid_checkpoints_by_kind", "checkpoints_by_kind", "state checkpoints held"),
        ):
            g = GaugeMetricFamily(
                name,
                f"{doc} by kind (interval, prompt_end, sequence_end, junction) and tier",
                labels=["kind", "tier"],
            )
            for kind, tiers in ledger.get(key, {}).items():
                for tier, n in tiers.items():
                    g.add_metric([kind, tier], n)
            yield g
        memory = snap.get("memory", {})
        g = GaugeMetricFamily("jaxhybrid_kv_pool_bytes", "paged KV pool bytes", labels=["state"])
        for state in ("total", "used", "free"):
            g.add_metric([state], memory.get(f"kv_bytes_{state}", 0))
        yield g
        g = GaugeMetricFamily("jaxhybrid_state_pool_bytes", "KDA state pool bytes (all slots)")
        g.add_metric([], memory.get("state_pool_bytes", 0))
        yield g
        g = GaugeMetricFamily(
            "jaxhybrid_model_bytes", "bytes of the model's arrays as held (MXFP4 experts packed: 4.25 bits)"
        )
        g.add_metric([], memory.get("model_bytes", 0))
        yield g


class ServerMetrics:
    """The server's registry and its request-level series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "jaxhybrid_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "jaxhybrid_request_latency_seconds",
            "time from receiving a request to its last byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "jaxhybrid_time_to_first_token_seconds",
            "time from receiving a request to its first generated token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_rate = Histogram(
            "jaxhybrid_request_tokens_per_second",
            "per request: generated tokens per second after the first token",
            ["endpoint"],
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("jaxhybrid_prompt_tokens", "prompt tokens served", registry=r)
        self.generation_tokens = Counter(
            "jaxhybrid_generation_tokens", "tokens generated for clients", registry=r
        )
        self.cached_tokens = Counter(
            "jaxhybrid_cached_prompt_tokens", "prompt tokens served from the prefix store", registry=r
        )
        self.engine = EngineCollector()
        r.register(self.engine)

    def finish(
        self,
        endpoint: str,
        latency: float,
        ttft: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        decode_seconds: float | None,
    ) -> None:
        """Record one completed generation."""
        self.latency.labels(endpoint).observe(latency)
        if ttft is not None:
            self.ttft.labels(endpoint).observe(ttft)
        if decode_seconds and decode_seconds > 0 and completion_tokens > 1:
            self.request_rate.labels(endpoint).observe((completion_tokens - 1) / decode_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
