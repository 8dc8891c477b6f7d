"""Prometheus metrics of one server, in their own registry (no process-global state).

Names carry units (`_seconds`, `_tokens`); `queue_depth` is a gauge read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("slipstream_queue_depth", "requests waiting for a batch", registry=r)
        self.batch_size = Histogram(
            "slipstream_batch_size",
            "real requests per forward pass",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.queue_seconds = Histogram(
            "slipstream_queue_seconds",
            "time from admission to the start of the request's forward",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "slipstream_compute_seconds",
            "seconds per forward pass (one planned shape)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "slipstream_requests",
            "finished requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "slipstream_rejections", "requests refused before compute, by reason", ["reason"], registry=r
        )
        self.padded_tokens = Counter("slipstream_padded_tokens", "padding tokens computed", registry=r)
        self.real_tokens = Counter("slipstream_real_tokens", "request tokens computed", registry=r)
        self.generated_tokens = Counter(
            "slipstream_generated_tokens", "tokens produced by /v1/generate", registry=r
        )
        self.decode_batch = Histogram(
            "slipstream_decode_batch_size",
            "active sequences per decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
