"""The gateway exports each worker's prefix tiers (LoadReport.kv_tiers) per tier: hits, bytes,
saves queued / written / dropped{reason}, read errors{reason}, latency histograms and the
cost model's estimate; the exposition parses as Prometheus text."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from protos.splitserve.v1 import common_pb2


@dataclass
class _Worker:
    address: str
    load: common_pb2.LoadReport
    healthy: bool = True
    reported: bool = True


def _histogram(counts: list[int], total: float) -> common_pb2.LatencyHistogram:
    return common_pb2.LatencyHistogram(bounds=[0.01, 0.1, 1.0], counts=counts, sum=total)


def test_tier_series_per_worker_and_tier() -> None:
    redis = common_pb2.KvTierStats(
        tier="redis", hit_blocks=90, hit_bytes=90 << 20, misses=3,
        read_errors={"corrupt": 2, "timeout": 1}, read_seconds=_histogram([1, 4, 2, 1], 3.5),
        saves_queued=100, saves_written=70, written_bytes=70 << 20,
        saves_dropped={"timeout": 20, "queue_full": 10},
        write_seconds=_histogram([0, 0, 5, 0], 2.0), cost_skips=4,
        read_latency_s=0.002, read_bytes_per_s=3e8)
    cpu = common_pb2.KvTierStats(tier="cpu", hit_blocks=12, saves_queued=5, saves_written=5)
    metrics = GatewayMetrics()
    metrics.observe_workers("prefill", [_Worker("127.0.0.1:1", common_pb2.LoadReport(
        kv_tiers=[cpu, redis], tier_saved_blocks=75))])
    samples = {(s.name, s.labels.get("tier"), s.labels.get("reason"), s.labels.get("le")):
               s.value for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples if s.labels.get("worker") == "127.0.0.1:1"}
    assert samples[("splitserve:kv_tier_hits_total", "redis", None, None)] == 90
    assert samples[("splitserve:kv_tier_hits_total", "cpu", None, None)] == 12
    assert samples[("splitserve:kv_tier_hit_bytes_total", "redis", None, None)] == 90 << 20
    assert samples[("splitserve:kv_tier_saves_queued_total", "redis", None, None)] == 100
    assert samples[("splitserve:kv_tier_saves_written_total", "redis", None, None)] == 70
    assert samples[("splitserve:kv_tier_saves_dropped_total", "redis", "timeout", None)] == 20
    assert samples[("splitserve:kv_tier_saves_dropped_total", "redis", "queue_full", None)] == 10
    assert samples[("splitserve:kv_tier_read_errors_total", "redis", "corrupt", None)] == 2
    assert samples[("splitserve:kv_tier_cost_skips_total", "redis", None, None)] == 4
    # Buckets are cumulative; +Inf is the count.
    assert samples[("splitserve:kv_tier_read_seconds_bucket", "redis", None, "0.1")] == 5
    assert samples[("splitserve:kv_tier_read_seconds_bucket", "redis", None, "+Inf")] == 8
    assert samples[("splitserve:kv_tier_read_seconds_count", "redis", None, None)] == 8
    assert samples[("splitserve:kv_tier_read_seconds_sum", "redis", None, None)] == 3.5
    assert samples[("splitserve:kv_tier_read_bytes_per_second", "redis", None, None)] == 3e8
    assert samples[("splitserve:kv_tier_saved_blocks_total", None, None, None)] == 75
