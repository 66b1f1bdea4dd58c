"""RunKeepingBlockPool: prompts stay in runs of consecutive blocks over a worker's life, the
younger free blocks are handed out only in their LRU turn, and the role decides the pool.
(The random-traffic properties are in test_kv_manager_props.py.)"""

from __future__ import annotations

import argparse
import statistics

import pytest

from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from engine.kv.block_pool import BlockPool, RunKeepingBlockPool
from tools.probes.probe_block_runs import simulate


def _life(pool: BlockPool, shared_prefixes: int = 0,
          stats: dict[str, int] | None = None) -> list[int]:
    """Runs per pulled prompt over a small decode worker's life (the probe's simulation)."""
    args = argparse.Namespace(block_size=16, concurrency=16, requests=400, min_prompt=128,
                              max_prompt=1024, min_output=16, max_output=512, seed=1,
                              growth_chunk=1, shared_prefixes=shared_prefixes)
    return simulate(pool, args, stats)


def test_prompts_stay_in_runs_where_lru_scatters_them() -> None:
    lru = _life(BlockPool(2000, enable_caching=True))
    keeping = RunKeepingBlockPool(2000, enable_caching=True)
    kept = _life(keeping)
    keeping.check_integrity()
    assert len(lru) == len(kept) == 400
    # After the first 100 pulls (a fresh pool is one run either way): prompts average
    # ~36 blocks; LRU hands them out scattered, the run-keeping pool in a few runs.
    lru_mean, kept_mean = statistics.fmean(lru[100:]), statistics.fmean(kept[100:])
    assert lru_mean > 15, lru_mean
    assert kept_mean < 4, kept_mean


def test_prefix_cache_hits_are_kept() -> None:
    """Only the older half of the free blocks goes out of LRU order, so prompts that share
    prefixes find them cached as often as with LRU (taking any free block out of order,
    `old_fraction=1.0`, loses ~5 points here)."""
    lru: dict[str, int] = {}
    kept: dict[str, int] = {}
    _life(BlockPool(2000, enable_caching=True), 20, lru)
    runs = _life(RunKeepingBlockPool(2000, enable_caching=True), 20, kept)
    lru_rate, kept_rate = (c["hit_blocks"] / c["prefix_blocks"] for c in (lru, kept))
    assert 0.5 < lru_rate < 0.95, lru_rate  # the workload does evict prefixes
    assert kept_rate >= lru_rate - 0.02, (kept_rate, lru_rate)
    assert statistics.fmean(runs[100:]) < 5


def test_single_blocks_come_from_the_top_of_the_older_blocks() -> None:
    pool = RunKeepingBlockPool(8, enable_caching=False)  # older half: 0-3, younger: 4-7
    assert [b.block_id for b in pool.free_queue if b.old] == [0, 1, 2, 3]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3]  # not 7: younger
    pool.check_integrity()


def test_prompts_take_the_older_neighbours_of_the_least_recently_freed() -> None:
    pool = RunKeepingBlockPool(16, enable_caching=False)
    held = pool.get_new_blocks(16)
    # Free 10, 11, 12, 13 first, then the rest: 10 is the least recently freed; 9 and 14 are
    # freed later but are among the older half of the queue.
    order = [10, 11, 12, 13, 9, 14, 0, 1, 2, 3, 4, 5, 6, 7, 8, 15]
    pool.free_blocks([held[i] for i in order])
    assert [b.block_id for b in pool.free_queue if b.old] == order[:8]
    # Seed 10, up over 11-14 (15 is younger), down over 9: one run.
    assert [b.block_id for b in pool.get_new_blocks(6)] == [9, 10, 11, 12, 13, 14]
    pool.check_integrity()


def test_lru_pool_takes_the_least_recently_freed() -> None:
    pool = BlockPool(8, enable_caching=False)
    held = pool.get_new_blocks(8)
    pool.free_blocks([held[i] for i in (5, 2, 7, 0, 1, 3, 4, 6)])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 5, 7]


def test_the_heap_of_older_blocks_stays_bounded_without_single_blocks() -> None:
    # A prefill worker's life: prompts only, never one block at a time, so nobody pops the heap.
    pool = RunKeepingBlockPool(256, enable_caching=False)
    for i in range(2000):
        held = pool.get_new_blocks(1 + i % 37)
        pool.free_blocks(list(reversed(held)))
        assert len(pool._old_ids) <= 2 * pool.num_old + 64
    pool.check_integrity()


def test_old_fraction_is_checked() -> None:
    with pytest.raises(ValueError, match="old_fraction"):
        RunKeepingBlockPool(8, enable_caching=False, old_fraction=0.0)


@pytest.mark.parametrize(("mode", "role", "keeps"), [
    ("auto", "colocated", False), ("auto", "prefill", True), ("auto", "decode", True),
    ("lru", "decode", False), ("runs", "colocated", True)])
def test_the_role_decides_the_pool(mode: str, role: str, keeps: bool) -> None:
    config = EngineConfig(cache=CacheConfig(block_allocation=mode),  # type: ignore[arg-type]
                          scheduler=SchedulerConfig(role=role))  # type: ignore[arg-type]
    assert config.keeps_block_runs() is keeps


def test_block_allocation_flag_and_validation() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--block-allocation", "runs"])
    assert engine_config_from_args(args).cache.block_allocation == "runs"
    with pytest.raises(SystemExit):
        p.parse_args(["--block-allocation", "buddy"])
    with pytest.raises(ConfigError, match="block_allocation"):
        CacheConfig(block_allocation="buddy").validate()  # type: ignore[arg-type]
