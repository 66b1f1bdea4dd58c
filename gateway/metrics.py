"""Prometheus metrics of the gateway, named like vLLM's with the `splitserve:` prefix.

One `GatewayMetrics` per gateway instance owns its own `CollectorRegistry` (no global
singletons, so several gateways can live in one test process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class GatewayMetrics:
    """Counters and histograms updated by the orchestrator and the API layers."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_received = Counter(
            "splitserve:requests_received", "Requests accepted by the gateway.",
            ["api"], registry=r)
        self.request_success = Counter(
            "splitserve:request_success", "Completions finished, by finish reason.",
            ["finished_reason"], registry=r)
        self.request_failure = Counter(
            "splitserve:request_failure", "Requests that failed, by status.",
            ["code"], registry=r)
        self.prompt_tokens = Counter(
            "splitserve:prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(
            "splitserve:generation_tokens", "Tokens generated.", registry=r)
        self.num_requests_running = Gauge(
            "splitserve:num_requests_running", "Requests in flight in the gateway.", registry=r)
        self.time_to_first_token = Histogram(
            "splitserve:time_to_first_token_seconds", "Time to the first token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "splitserve:inter_token_latency_seconds", "Time between streamed token deltas.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "splitserve:e2e_request_latency_seconds", "Request latency, arrival to finish.",
            buckets=_E2E_BUCKETS, registry=r)
        self.decode_resumes = Counter(
            "splitserve:decode_resumes", "Requests resumed on another decode worker.",
            registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
