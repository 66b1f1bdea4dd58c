"""A worker's prefix-tier metrics as `LoadReport` fields: one `KvTierStats` per tier (hits,
bytes, misses, read errors and saves dropped by reason, read/write latency histograms, the cost
model's read estimate), plus the two totals older gateways read.

The one place these values are computed from the tiers' counters: the gateway exports what
the LoadReport carries (gateway/metrics.py), and a worker-side exporter can read the same
messages from `tier_stats`.
"""

from __future__ import annotations

from kv_transfer.tiers import LatencyHistogram, TierCounters
from protos.splitserve.v1 import common_pb2
from worker.tier_cache import TierPrefixCache


def tier_stats(tiers: TierPrefixCache) -> list[common_pb2.KvTierStats]:
    """Each tier's counters as messages, CPU first."""
    return [_tier(c) for c in tiers.store.tiers]


def fill_tier_report(report: common_pb2.LoadReport, tiers: TierPrefixCache | None) -> None:
    """Set the report's tier fields (none without tiers)."""
    if tiers is None:
        return
    stats = tier_stats(tiers)
    report.kv_tiers.extend(stats)
    report.tier_hit_tokens = tiers.stats.loaded_tokens
    report.tier_saved_blocks = sum(s.saves_written for s in stats)


def _tier(c: TierCounters) -> common_pb2.KvTierStats:
    return common_pb2.KvTierStats(
        tier=c.tier, hit_blocks=c.hits, hit_bytes=c.hit_bytes, misses=c.misses,
        read_errors=dict(c.read_errors), read_seconds=_histogram(c.reads),
        saves_queued=c.saves_queued, saves_written=c.saves_written,
        written_bytes=c.written_bytes, saves_dropped=dict(c.saves_dropped),
        write_seconds=_histogram(c.writes), cost_skips=c.cost_skips,
        read_latency_s=c.cost.latency_s, read_bytes_per_s=c.cost.bytes_per_s)


def _histogram(h: LatencyHistogram) -> common_pb2.LatencyHistogram:
    return common_pb2.LatencyHistogram(bounds=h.bounds, counts=h.counts, sum=h.sum)
