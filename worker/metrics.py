"""A worker's own Prometheus `/metrics`: its engine's series, scraped per pod (a PodMonitor).

The gateway mirrors every worker's last load report into its own scrape (labelled by worker
address); that view depends on which gateway one asks and on its last poll. Here each worker
serves its own series, read at scrape time: the engine's running and waiting requests, KV
usage, prefix-cache queries and hits, preemptions, leases, KV pulls by way, prefix-tier hits,
speculative drafts, and whether it is draining. Names carry `splitserve:engine_` (the
gateway's mirrored series keep theirs, so a sum over both never counts twice); every series
has vLLM's `model_name` label and the worker's `role`.

The HTTP server is prometheus_client's (a daemon thread); a scrape asks the worker's event loop
for the report, as a `GetLoad` call would, so the engine's state is read where it always is.
With the internal TLS files set (rpc/tls.py) it serves HTTPS with the worker's certificate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protos.splitserve.v1 import common_pb2
from rpc.tls import tls_paths_from_env
from worker.tier_cache import TierPrefixCache

log = logging.getLogger(__name__)

Report = common_pb2.LoadReport
LABELS = ("model_name", "role")
SCRAPE_TIMEOUT_S = 5.0

GAUGES: tuple[tuple[str, str, Callable[[Report], float]], ...] = (
    ("splitserve:engine_num_requests_running", "Requests in the engine's running batch.",
     lambda r: r.num_running),
    ("splitserve:engine_num_requests_waiting", "Requests waiting in the engine's queue "
     "(queued, preempted or loading their KV).", lambda r: r.num_waiting),
    ("splitserve:engine_kv_cache_usage_perc", "KV-cache usage (1 = all blocks in use).",
     lambda r: r.kv_cache_usage),
    ("splitserve:engine_kv_leases", "KV leases held for decode workers to pull (prefill).",
     lambda r: r.num_leases),
    ("splitserve:engine_lora_adapters", "LoRA adapters served now.",
     lambda r: len(r.lora_adapters)),
)
COUNTERS: tuple[tuple[str, str, Callable[[Report], float]], ...] = (
    ("splitserve:engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda r: r.prefix_cache_queries),
    ("splitserve:engine_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda r: r.prefix_cache_hits),
    ("splitserve:engine_num_preemptions", "Requests preempted by the scheduler.",
     lambda r: r.num_preemptions),
    ("splitserve:engine_kv_tier_hit_tokens", "Prompt tokens loaded from the CPU/Redis tiers "
     "instead of computed.", lambda r: r.tier_hit_tokens),
    ("splitserve:engine_kv_tier_saved_blocks", "KV blocks written to the CPU/Redis tiers.",
     lambda r: r.tier_saved_blocks),
    ("splitserve:engine_kv_handles_refused", "KV handles refused before any connection: "
     "they named an address outside the decode worker's --kv-peers.",
     lambda r: r.kv_handles_refused),
    ("splitserve:engine_spec_decode_num_draft_tokens", "Draft tokens verified.",
     lambda r: r.spec_draft_tokens),
    ("splitserve:engine_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     lambda r: r.spec_accepted_tokens),
)
# Decode workers' KV pulls, by way (`transport`: cuda_ipc, tcp, shm, stream).
TRANSPORT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("splitserve:engine_kv_pulls", "KV loads completed, by the way they came.", "pulls"),
    ("splitserve:engine_kv_pull_bytes", "KV bytes pulled, by way.", "bytes"),
    ("splitserve:engine_kv_pull_seconds", "Time spent pulling KV, by way.", "seconds"),
)
DRAINING = "splitserve:engine_draining"
CALLS = "splitserve:engine_calls_in_progress"
CALLS_STARTED = "splitserve:engine_calls_started"


class ReportSource(Protocol):
    """What the metrics read of a worker's servicer (`worker.common.EngineBound` with tiers)."""

    @property
    def tiers(self) -> TierPrefixCache | None: ...

    def load_report(self, role: str) -> Report: ...


class WorkerState(Protocol):
    """What the metrics read of the worker itself (`worker.drain.DrainGate` fits)."""

    @property
    def draining(self) -> bool: ...
    @property
    def active(self) -> int: ...
    @property
    def started(self) -> Mapping[str, int]: ...


def report_now(source: ReportSource, role: str) -> Report:
    """The worker's load report with its prefix tiers' totals (what `GetLoad` answers)."""
    report = source.load_report(role)
    if source.tiers is not None:
        report.tier_hit_tokens = source.tiers.stats.loaded_tokens
        report.tier_saved_blocks = source.tiers.stats.saved_blocks
    return report


class WorkerCollector:
    """The worker's families, built at scrape time from a report taken on its event loop."""

    def __init__(self, report: Callable[[], Report | None], state: WorkerState,
                 model_name: str, role: str, loop: asyncio.AbstractEventLoop) -> None:
        self._report = report
        self._state = state
        self._labels = [model_name, role]
        self._loop = loop

    def _snapshot(self) -> Report | None:
        """The report (None while the engine loads), taken on the loop between its tasks."""
        async def take() -> Report | None:
            return self._report()

        future = asyncio.run_coroutine_threadsafe(take(), self._loop)
        return future.result(SCRAPE_TIMEOUT_S)

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._snapshot())

    def _families(self, report: Report | None) -> Iterator[Metric]:
        labels = self._labels
        draining = GaugeMetricFamily(DRAINING, "1 once the worker is draining (SIGTERM): it "
                                     "refuses new requests and exits when its work ended.",
                                     labels=LABELS)
        draining.add_metric(labels, float(self._state.draining))
        yield draining
        calls = GaugeMetricFamily(CALLS, "gRPC calls in progress on the worker (health checks "
                                  "not counted).", labels=LABELS)
        calls.add_metric(labels, float(self._state.active))
        yield calls
        started = CounterMetricFamily(CALLS_STARTED, "gRPC calls the worker accepted, by method "
                                      "(Prefill, Decode, GetLoad, KV pulls...).",
                                      labels=[*LABELS, "method"])
        for method, count in sorted(self._state.started.items()):
            started.add_metric([*labels, method], float(count))
        yield started
        for name, doc, value in GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            if report is not None:
                gauge.add_metric(labels, float(value(report)))
            yield gauge
        for name, doc, value in COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            if report is not None:
                counter.add_metric(labels, float(value(report)))
            yield counter
        for name, doc, field in TRANSPORT_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=[*LABELS, "transport"])
            for t in report.kv_transports if report is not None else ():
                family.add_metric([*labels, t.transport], float(getattr(t, field)))
            yield family


class MetricsServer:
    """`/metrics` of one worker on `host:port` (0: a free port; `port` says which)."""

    def __init__(self, collector: WorkerCollector, host: str, port: int) -> None:
        registry = CollectorRegistry()
        registry.register(collector)
        tls = tls_paths_from_env()
        self._httpd, self._thread = start_http_server(
            port, host, registry=registry, certfile=tls.cert if tls else None,
            keyfile=tls.key if tls else None)
        self.port: int = self._httpd.server_port
        log.info("metrics on %s://%s:%d/metrics", "https" if tls else "http", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
