"""Prometheus metrics of the gateway, named like vLLM's with the `splitserve:` prefix.

One `GatewayMetrics` per gateway instance owns its own `CollectorRegistry` (no global
singletons, so several gateways can live in one test process).

Two kinds of series share the registry:
- the gateway's own counters and histograms, updated by the orchestrator and the API layers;
- per-worker series labelled `{role, worker}` (worker = its `host:port`), mirrored from the
  `LoadReport` each worker answered to the router's last `GetLoad` poll, so one scrape of the
  gateway shows the whole stack (the workers serve no /metrics themselves).

The workers report cumulative totals (prefix-cache queries, hits, preemptions, speculative
draft tokens verified and accepted) that only they can count; `prometheus_client` counters
cannot be *set*, so those are exposed by a custom collector (`WorkerLoadCollector`) as real
`counter` families (`# TYPE … counter`, samples `…_total`) whose values are the workers' own
totals. A worker restart resets its totals, which
Prometheus' `rate()` handles as a counter reset.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gateway.request_metrics import ModelLabelled, RequestHistograms
from gateway.response_store import ResponseStore
from gateway.spec_metrics import SpecMetrics
from gateway.spec_policy import SpecDecision
from protos.splitserve.v1 import common_pb2

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)

WORKER_LABELS = ("role", "worker")
Report = common_pb2.LoadReport

# Worker gauges, exported for healthy workers only (a failed poll leaves a stale report).
# vLLM semantics: usage is a fraction in [0, 1]; running/waiting count the engine's requests.
WORKER_GAUGES: tuple[tuple[str, str, Callable[[Report], float]], ...] = (
    ("splitserve:kv_cache_usage_perc", "KV-cache usage of the worker (1 = all blocks in use).",
     lambda r: r.kv_cache_usage),
    ("splitserve:num_requests_running", "Requests in the worker engine's running batch.",
     lambda r: r.num_running),
    ("splitserve:num_requests_waiting", "Requests waiting in the worker engine's queue.",
     lambda r: r.num_waiting),
    ("splitserve:kv_leases", "KV leases the worker holds for decode workers to pull.",
     lambda r: r.num_leases),
    ("splitserve:lora_adapters", "LoRA adapters the worker serves now.",
     lambda r: len(r.lora_adapters)),
    ("splitserve:lora_slots", "LoRA adapter slots of the worker (--max-loras; 0: its adapters "
     "are fixed at start).", lambda r: r.max_loras),
)
LORA_INFO = "splitserve:lora_requests_info"
# Worker counters (cumulative totals the workers count), exported once a worker has reported.
WORKER_COUNTERS: tuple[tuple[str, str, Callable[[Report], float]], ...] = (
    ("splitserve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
     lambda r: r.prefix_cache_queries),
    ("splitserve:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
     lambda r: r.prefix_cache_hits),
    ("splitserve:num_preemptions_total", "Requests preempted by the worker's scheduler.",
     lambda r: r.num_preemptions),
    ("splitserve:kv_tier_hit_tokens_total",
     "Prompt tokens a worker loaded from its CPU/Redis tiers instead of computing.",
     lambda r: r.tier_hit_tokens),
    ("splitserve:kv_tier_saved_blocks_total",
     "KV block writes that landed in a worker's tiers, summed over the tiers (per tier: "
     "kv_tier_saves_written_total).",
     lambda r: r.tier_saved_blocks),
    # vLLM's names; acceptance rate = rate(accepted) / rate(draft).
    ("splitserve:spec_decode_num_draft_tokens_total",
     "Draft tokens a worker verified with speculative decoding.",
     lambda r: r.spec_draft_tokens),
    ("splitserve:spec_decode_num_accepted_tokens_total",
     "Draft tokens a worker accepted with speculative decoding.",
     lambda r: r.spec_accepted_tokens),
)
WORKER_HEALTHY = "splitserve:worker_healthy"


class PolledWorker(Protocol):
    """What the metrics read of a router worker (`gateway.router.Worker` fits)."""

    @property
    def address(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def reported(self) -> bool: ...
    @property
    def load(self) -> Report: ...


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker as of the router's last poll. `load` is None until it first answered."""

    role: str
    worker: str
    healthy: bool
    load: Report | None


class WorkerLoadCollector:
    """Per-worker families built at scrape time from the last poll of each pool.

    `update` replaces one role's samples as a whole (one assignment), so a scrape running in
    another thread sees either the previous poll round or the new one, never a mix.
    """

    def __init__(self) -> None:
        self._samples: dict[str, tuple[WorkerSample, ...]] = {}

    def update(self, role: str, workers: Iterable[PolledWorker]) -> None:
        samples = tuple(WorkerSample(role, w.address, w.healthy, w.load if w.reported else None)
                        for w in workers)
        self._samples = self._samples | {role: samples}

    def describe(self) -> Iterator[Metric]:
        """The families without samples (lets the registry refuse clashing names)."""
        return self._families(())

    def samples(self) -> tuple[WorkerSample, ...]:
        """Every pool's workers as of its last poll."""
        return tuple(s for group in self._samples.values() for s in group)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.samples())

    @staticmethod
    def _families(samples: Sequence[WorkerSample]) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(WORKER_HEALTHY, "1 if the worker answered the last load poll.",
                                    labels=WORKER_LABELS)
        for s in samples:
            healthy.add_metric([s.role, s.worker], float(s.healthy))
        yield healthy
        for name, doc, value in WORKER_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=WORKER_LABELS)
            for s in samples:
                if s.healthy and s.load is not None:
                    gauge.add_metric([s.role, s.worker], float(value(s.load)))
            yield gauge
        for name, doc, value in WORKER_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=WORKER_LABELS)
            for s in samples:
                if s.load is not None:
                    counter.add_metric([s.role, s.worker], float(value(s.load)))
            yield counter
        yield from _kv_transport_families(samples)
        yield from _kv_tier_families(samples)
        yield _lora_info_family(samples)


class CacheConfigCollector:
    """vLLM's `cache_config_info` per worker: its KV cache's size in blocks
    (`num_gpu_blocks`, the engine's blocks on whichever device), from its load reports."""

    def __init__(self, workers: WorkerLoadCollector) -> None:
        self._workers = workers

    def describe(self) -> Iterator[Metric]:
        return self._family(())

    def collect(self) -> Iterator[Metric]:
        return self._family(self._workers.samples())

    @staticmethod
    def _family(samples: Iterable[WorkerSample]) -> Iterator[Metric]:
        info = GaugeMetricFamily("splitserve:cache_config_info",
                                 "Information of a worker's KV cache (value 1).",
                                 labels=[*WORKER_LABELS, "num_gpu_blocks"])
        for s in samples:
            if s.load is not None:
                info.add_metric([s.role, s.worker, str(s.load.num_blocks)], 1.0)
        yield info


def _lora_info_family(samples: Sequence[WorkerSample]) -> Metric:
    """vLLM's `lora_requests_info`: per healthy worker, its slots and the adapters with requests
    running / waiting (comma-separated names in labels; the value is the scrape's time)."""
    info = GaugeMetricFamily(
        LORA_INFO, "LoRA adapters with requests running and waiting on the worker.",
        labels=[*WORKER_LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    now = time.time()
    for s in samples:
        r = s.load
        if not s.healthy or r is None or not (r.lora_adapters or r.max_loras):
            continue
        rows = list(zip(r.lora_adapters, r.lora_running, r.lora_waiting, strict=False))
        info.add_metric([s.role, s.worker, str(r.max_loras),
                         ",".join(n for n, running, _ in rows if running),
                         ",".join(n for n, _, waiting in rows if waiting)], now)
    return info


def _kv_transport_families(samples: Sequence[WorkerSample]) -> Iterator[Metric]:
    """Decode workers' KV pulls per way (`transport` label: cuda_ipc, tcp, shm, stream)."""
    labels = (*WORKER_LABELS, "transport")
    families = {
        "pulls": CounterMetricFamily(
            "splitserve:kv_pulls", "KV loads a decode worker completed, by the way they came.",
            labels=labels),
        "bytes": CounterMetricFamily(
            "splitserve:kv_pull_bytes", "KV bytes decode workers pulled, by way.", labels=labels),
        "seconds": CounterMetricFamily(
            "splitserve:kv_pull_seconds", "Time decode workers spent pulling KV (from asking to "
            "the blocks in their cache), by way.", labels=labels),
        "block_runs": CounterMetricFamily(
            "splitserve:kv_pull_block_runs", "Runs of consecutive block ids the pulled KV took "
            "in decode workers' caches, by way: per pull ~1 unless the pool is fragmented (a "
            "same-GPU pull copies at least one per run).", labels=labels),
    }
    for s in samples:
        for t in s.load.kv_transports if s.load is not None else ():
            for field, family in families.items():
                family.add_metric([s.role, s.worker, t.transport], float(getattr(t, field)))
    yield from families.values()


# Per worker and tier (`tier`: cpu or redis): LoadReport.kv_tiers' counters.
_TIER_COUNTERS: tuple[tuple[str, str, Callable[[common_pb2.KvTierStats], float]], ...] = (
    ("splitserve:kv_tier_hits", "KV blocks a worker found (and verified) in a prefix tier.",
     lambda t: t.hit_blocks),
    ("splitserve:kv_tier_hit_bytes", "Bytes of the KV blocks a worker read from a prefix tier.",
     lambda t: t.hit_bytes),
    ("splitserve:kv_tier_misses", "Prefix lookups that ended at a tier (its next block absent).",
     lambda t: t.misses),
    ("splitserve:kv_tier_saves_queued", "KV blocks a worker handed to a tier for saving.",
     lambda t: t.saves_queued),
    ("splitserve:kv_tier_saves_written", "KV blocks a tier acknowledged as written.",
     lambda t: t.saves_written),
    ("splitserve:kv_tier_saved_bytes", "Bytes of the KV blocks a tier acknowledged as written.",
     lambda t: t.written_bytes),
    ("splitserve:kv_tier_cost_skips", "Tier reads not made because the worker estimated that "
     "computing the blocks was faster.", lambda t: t.cost_skips),
)
_TIER_REASONS: tuple[tuple[str, str, Callable[[common_pb2.KvTierStats], Mapping[str, int]]],
                     ...] = (
    ("splitserve:kv_tier_saves_dropped", "KV blocks a tier never wrote, by reason: queue_full "
     "(the write queue's bound), timeout, connection, full (Redis maxmemory), budget (the "
     "tier's own bound), backoff (paused after a failure), oversize, rejected, shutdown, error.",
     lambda t: t.saves_dropped),
    ("splitserve:kv_tier_read_errors", "Tier reads that failed, by reason: corrupt (a value "
     "that is not this model's, this salt's or this block's KV), timeout, connection, backoff, "
     "oversize, error.", lambda t: t.read_errors),
)
_TIER_HISTOGRAMS: tuple[tuple[str, str, Callable[[common_pb2.KvTierStats],
                                                 common_pb2.LatencyHistogram]], ...] = (
    ("splitserve:kv_tier_read_seconds", "Time of one prefix-tier read (a Redis chunk).",
     lambda t: t.read_seconds),
    ("splitserve:kv_tier_write_seconds", "Time of one prefix-tier write (a Redis chunk).",
     lambda t: t.write_seconds),
)
_TIER_GAUGES: tuple[tuple[str, str, Callable[[common_pb2.KvTierStats], float]], ...] = (
    ("splitserve:kv_tier_read_latency_seconds", "A tier read's latency as the worker's "
     "fetch-or-recompute model estimates it now.", lambda t: t.read_latency_s),
    ("splitserve:kv_tier_read_bytes_per_second", "A tier's read bandwidth as the worker's "
     "fetch-or-recompute model estimates it now.", lambda t: t.read_bytes_per_s),
)


def _kv_tier_families(samples: Sequence[WorkerSample]) -> Iterator[Metric]:
    """Each worker's prefix tiers, labelled `tier` (and `reason` for drops and read errors)."""
    labels = (*WORKER_LABELS, "tier")
    tiers = [(s, t) for s in samples if s.load is not None for t in s.load.kv_tiers]
    for name, doc, value in _TIER_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=labels)
        for s, t in tiers:
            counter.add_metric([s.role, s.worker, t.tier], float(value(t)))
        yield counter
    for name, doc, reasons in _TIER_REASONS:
        counter = CounterMetricFamily(name, doc, labels=(*labels, "reason"))
        for s, t in tiers:
            for reason, count in sorted(reasons(t).items()):
                counter.add_metric([s.role, s.worker, t.tier, reason], float(count))
        yield counter
    for name, doc, histogram in _TIER_HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=labels)
        for s, t in tiers:
            h = histogram(t)
            if len(h.counts) != len(h.bounds) + 1:
                continue  # not a histogram this gateway can read
            cumulative = list(itertools.accumulate(h.counts))
            buckets = [(_bound(b), float(n)) for b, n in zip(h.bounds, cumulative, strict=False)]
            family.add_metric([s.role, s.worker, t.tier],
                              [*buckets, ("+Inf", float(cumulative[-1]))], h.sum)
        yield family
    for name, doc, value in _TIER_GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=labels)
        for s, t in tiers:
            if s.healthy:
                gauge.add_metric([s.role, s.worker, t.tier], float(value(t)))
        yield gauge


def _bound(bound: float) -> str:
    return repr(float(bound))


class GatewayMetrics:
    """Counters and histograms updated by the orchestrator and the API layers, plus the
    workers' series updated by `observe_workers` after every router poll round."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str = "", max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # What /metrics shows: every series labelled with the served model's name.
        self.exposed = ModelLabelled(r, model_name)
        # The process's CPU, memory, file descriptors and start time (process_*), and the
        # Python runtime's (python_info, python_gc_*), as vLLM's /metrics has them.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.request_phases = RequestHistograms(r, max_model_len)
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
        # Not `num_requests_running`: that name is the workers' (vLLM's meaning, per engine).
        self.num_requests_in_flight = Gauge(
            "splitserve:gateway_requests_in_flight", "Requests in flight in the gateway.",
            registry=r)
        self.time_to_first_token = Histogram(
            "splitserve:time_to_first_token_seconds", "Time to the first token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "splitserve:inter_token_latency_seconds", "Time between streamed token deltas.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "splitserve:e2e_request_latency_seconds", "Request latency, arrival to finish.",
            buckets=_E2E_BUCKETS, registry=r)
        self.requests_refused = Counter(
            "splitserve:requests_refused",
            "Requests refused for load (429, RESOURCE_EXHAUSTED), by reason: gateway_limit "
            "(--max-concurrent-requests in flight at this gateway) or workers_overloaded "
            "(every worker of a pool was full).", ["reason"], registry=r)
        self.requests_aborted = Counter(
            "splitserve:requests_aborted",
            "Requests whose client went away before they finished (REST disconnect, gRPC "
            "cancel), their downstream calls cancelled, by api: rest or grpc.", ["api"],
            registry=r)
        self.decode_resumes = Counter(
            "splitserve:decode_resumes", "Requests resumed on another decode worker.",
            registry=r)
        self.stream_send_timeouts = Counter(
            "splitserve:stream_send_timeouts",
            "Streams cut because their client took no data for stream_send_timeout_s (it "
            "stopped reading), by api: rest or grpc. Each is also in requests_aborted.",
            ["api"], registry=r)
        for api in ("rest", "grpc"):  # exposed at 0 from the start
            self.stream_send_timeouts.labels(api=api)
        self.decode_stalls = Counter(
            "splitserve:decode_stalls", "Decode streams abandoned because their worker stopped "
            "answering (no token, then no health answer in time), each resumed elsewhere.",
            registry=r)
        self.spec_decode_decisions = Counter(
            "splitserve:spec_decode_decisions",
            "Decode calls by the speculative policy's choice: off (no drafts), draft_model, "
            "ngram, suffix, or default (drafts from the worker's own method).",
            ["speculation"], registry=r)
        self.structured_output_requests = Counter(
            "splitserve:structured_output_requests",
            "Requests whose output is constrained, by constraint: json_schema, json_object, "
            "regex, choice or grammar.", ["constraint"], registry=r)
        self.tool_call_requests = Counter(
            "splitserve:tool_call_requests",
            "Chat requests that sent tools, by tool_choice: none, auto, required or named.",
            ["tool_choice"], registry=r)
        self.stored_responses = Gauge(
            "splitserve:responses_stored",
            "Responses API responses the gateway keeps (GET /v1/responses/ID, "
            "previous_response_id).", registry=r)
        self.stored_response_bytes = Gauge(
            "splitserve:responses_stored_bytes",
            "Bytes the stored responses count against --responses-store-max-bytes.", registry=r)
        self.workers = WorkerLoadCollector()
        r.register(self.workers)
        r.register(CacheConfigCollector(self.workers))
        self.spec = SpecMetrics(r)

    def observe_response_store(self, store: ResponseStore) -> None:
        """Read the stored responses' count and bytes from `store` at each scrape."""
        self.stored_responses.set_function(lambda: len(store))
        self.stored_response_bytes.set_function(lambda: store.num_bytes)

    def observe_workers(self, role: str, workers: Iterable[PolledWorker]) -> None:
        """Replace `role`'s worker series with the pool's state after a poll round."""
        workers = list(workers)
        self.workers.update(role, workers)
        self.spec.workers.update(role, [(w.address, w.load) for w in workers if w.reported])

    def observe_spec_decision(self, worker: str, spec: SpecDecision) -> None:
        """The speculation policy's choice for a Decode call on `worker`."""
        self.spec_decode_decisions.labels(speculation=spec.label).inc()
        self.spec.observe_decision(worker, spec)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, labelled with the model's name."""
        return generate_latest(self.exposed)  # type: ignore[arg-type]  # has collect()
