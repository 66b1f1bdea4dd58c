"""Fetch or recompute by measured cost (worker/tier_cost.py, kv_transfer/tiers/counters.py)."""

from __future__ import annotations

import pytest

from kv_transfer.tiers import ReadCost, TierCounters
from worker.tier_cost import FetchCost

BLOCK_BYTES = 786_540  # a SmolLM2 float32 block of 16 tokens


def test_read_cost_fits_latency_and_bandwidth_and_forgets_old_reads() -> None:
    cost = ReadCost(prior_latency_s=0.5, prior_bytes_per_s=1.0)
    assert cost.seconds(100) == pytest.approx(100.5)  # the prior until a read is timed
    cost.observe(1_000_000, 0.011)
    assert cost.latency_s == 0 and cost.bytes_per_s == pytest.approx(1e6 / 0.011)
    cost.observe(2_000_000, 0.021)
    assert cost.latency_s == pytest.approx(0.001) and cost.bytes_per_s == pytest.approx(1e8)
    for _ in range(60):  # the tier slowed down tenfold: the estimate follows
        cost.observe(1_000_000, 0.101)
        cost.observe(2_000_000, 0.201)
    assert cost.bytes_per_s == pytest.approx(1e7, rel=0.05)


def test_fetches_only_what_arrives_before_it_would_be_computed() -> None:
    fetch = FetchCost(block_size=16, block_bytes=BLOCK_BYTES)
    redis = TierCounters("redis", cost=ReadCost(0.001, 200e6))
    assert fetch.worth(redis, 8)  # no prefill timed yet: use the tier
    fetch.observe_prefill(10, 1.0)  # too short to say anything
    assert fetch.prefill_tokens_per_s is None
    fetch.observe_prefill(1600, 2.0)  # 800 tokens/s: a CPU
    assert fetch.worth(redis, 8)  # 8 blocks: 32 ms from Redis vs 160 ms to compute
    fast = FetchCost(block_size=16, block_bytes=BLOCK_BYTES)
    fast.observe_prefill(160_000, 1.0)  # a GPU: 8 blocks in 0.8 ms, below Redis' latency
    assert not fast.worth(redis, 8)
    slow_redis = TierCounters("redis", cost=ReadCost(0.001, 200e6))
    for size in (1 << 20, 4 << 20):
        slow_redis.cost.observe(size, 1.0 + size / 1e6)  # 1 s latency, 1 MB/s
    assert not fetch.worth(slow_redis, 8)
    assert fetch.decisions == {"fetch": 2, "compute": 1, "overlap": 0}


def test_split_computes_the_head_while_the_tail_is_read_so_both_end_together() -> None:
    cost = FetchCost(block_size=16, block_bytes=BLOCK_BYTES)
    redis = TierCounters("redis", cost=ReadCost(0.001, 40e6))  # ~19.7 ms a block
    assert cost.split(redis, 100) == 0  # no prefill timed yet: fetch all
    cost.observe_prefill(1600, 2.0)  # 800 tokens/s: 20 ms a block
    head = cost.split(redis, 100)
    # 20 ms * k against 1 ms + 19.7 ms * (100 - k): they meet at k = 49.6, half the time
    assert head in (49, 50) and cost.last_split == (head, 100 - head)
    # A read 5x faster than computing: the best split (k = 16) saves 16% of fetching all,
    # under SPLIT_MIN_GAIN: fetch all.
    quick_read = TierCounters("redis", cost=ReadCost(0.001, 200e6))  # ~3.9 ms a block
    assert cost.split(quick_read, 100) == 0
    fast = FetchCost(block_size=16, block_bytes=BLOCK_BYTES)
    fast.observe_prefill(1_600_000, 1.0)  # a GPU: 100 blocks in 1 ms, below Redis' latency
    assert fast.split(redis, 100) == 100
    assert fast.decisions["compute"] == 1
    # A read that costs ~1 ms whatever its size: no split saves more than a split costs.
    quick = TierCounters("redis", cost=ReadCost(0.001, 1e12))
    assert cost.split(quick, 100) == 0 and cost.last_split == (0, 100)
    assert cost.decisions == {"fetch": 3, "compute": 0, "overlap": 1}


def test_a_split_barely_faster_than_computing_all_computes_all() -> None:
    """The H200's case (dummy 8B, 16k tokens): a block computes in 0.51 ms and reads in 5.2 ms.
    The best split (k = 913 of 1003 computed) ends in ~466 ms against 513 ms for computing all:
    under SPLIT_MIN_GAIN of the better whole way, so the worker computes all (a split measured
    697 ms there)."""
    block_bytes = 2 << 20  # 16 tokens x 128 KiB
    cost = FetchCost(block_size=16, block_bytes=block_bytes)
    cost.observe_prefill(31_300, 1.0)
    redis = TierCounters("redis", cost=ReadCost(0.0007, block_bytes / 5.2e-3))
    assert cost.split(redis, 1003) == 1003
    assert cost.decisions == {"fetch": 0, "compute": 1, "overlap": 0}
    # With a read 4x faster a split saves far more than its costs, and is taken.
    quicker = TierCounters("redis", cost=ReadCost(0.0007, block_bytes / 1.3e-3))
    head = cost.split(quicker, 1003)
    assert 0 < head < 1003 and cost.decisions["overlap"] == 1


def test_a_slow_first_prefill_does_not_set_the_rate() -> None:
    """The H200's 1k case: the first prefill of a shape took 638 ms (kernels compiled, graphs
    captured), the next ones 24 ms. A mean weighted 0.2 to the newest still read 9.6k
    tokens/s three prefills later and split a Redis hit that computing all beat 6x."""
    cost = FetchCost(block_size=16, block_bytes=2 << 20)
    cost.observe_prefill(1000, 0.638)
    for _ in range(3):
        cost.observe_prefill(1000, 0.024)
    assert cost.prefill_tokens_per_s == pytest.approx(1000 / 0.024)
    redis = TierCounters("redis", cost=ReadCost(0.0014, 0.59e9))
    assert cost.split(redis, 62) == 62  # compute all: a block reads ~9x slower than computed
    # A lasting slowdown (the worker under load) is followed within half the window.
    for _ in range(5):
        cost.observe_prefill(1000, 0.240)
    assert cost.prefill_tokens_per_s == pytest.approx(1000 / 0.240)
