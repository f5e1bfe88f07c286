"""The gateway's Prometheus metrics: requests and latency per route and status, time to first token per model."""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

# The `_created` series double every family and no dashboard of ours reads them.
disable_created_metrics()

#: Latency buckets in seconds: 1 ms to 2 minutes.
LATENCY_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                            60.0, 120.0)


class GatewayMetrics:
    """Families created once per gateway, in its own registry (so that two gateways in one process do not mix)."""

    def __init__(self) -> None:
        """Create the families."""
        self.registry = CollectorRegistry()
        self.requests = Counter("coalesce_gateway_requests_total", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("coalesce_gateway_request_duration_seconds",
                                 "Seconds from a request's arrival to its answer (a stream: to its last event)",
                                 ["route"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.first_token = Histogram("coalesce_gateway_time_to_first_token_seconds",
                                     "Seconds from a streamed generation's arrival to its first text",
                                     ["model"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.rows = Counter("coalesce_gateway_rows_total", "Texts embedded or pairs scored, by model",
                            ["model"], registry=self.registry)
        self.tokens = Counter("coalesce_gateway_tokens_total",
                              "Tokens in usage, by model and kind (prompt, completion)",
                              ["model", "kind"], registry=self.registry)
        self.cancelled = Counter("coalesce_gateway_cancelled_total",
                                 "Generations cancelled because their client went away, by model",
                                 ["model"], registry=self.registry)

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request."""
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def page(self) -> bytes:
        """The text exposition format, for ``GET /metrics``."""
        return generate_latest(self.registry)
