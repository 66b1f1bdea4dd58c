"""A CPU engine's KV cache left unset is sized from the model and the host's available memory,
not a fixed 2 GiB: `splitserve up` runs two engines on one small machine."""

from __future__ import annotations

from pathlib import Path

from engine.llm import LLM
from engine.runner.kv_sizing import (
    CPU_KV_AVAILABLE_SHARE,
    CPU_KV_MIN_BYTES,
    available_memory_bytes,
    default_cpu_kv_bytes,
    weight_bytes,
)

MIB = 1 << 20


def test_the_default_budget_is_the_weights_bounded_by_available_memory() -> None:
    seq = 10 * MIB
    assert default_cpu_kv_bytes(900 * MIB, seq, available=20_000 * MIB) == 900 * MIB
    # A 4 GB machine: a tenth of what is free, not the weights.
    assert default_cpu_kv_bytes(900 * MIB, seq, available=4_000 * MIB) == 400 * MIB
    # A tiny model still gets room for more than a handful of sequences.
    assert default_cpu_kv_bytes(1 * MIB, seq, available=20_000 * MIB) == CPU_KV_MIN_BYTES
    # Never below one sequence at full length, even with almost nothing free.
    assert default_cpu_kv_bytes(900 * MIB, seq, available=50 * MIB) == seq
    assert default_cpu_kv_bytes(900 * MIB, seq, available=None) == 900 * MIB


def test_available_memory_is_read_from_the_host() -> None:
    available = available_memory_bytes()
    assert available is not None and available > 0


def test_an_engine_left_unset_sizes_its_cache_from_the_model_and_memory(
        tiny_model_dirs: dict[str, Path]) -> None:
    before = available_memory_bytes()
    assert before is not None
    llm = LLM(model=str(tiny_model_dirs["llama"]), device="cpu", max_model_len=256)
    runner = llm.engine.runner
    kv = runner.kv
    cache_bytes = kv.num_blocks * kv.block_bytes
    sequence = (256 // kv.block_size + 1) * kv.block_bytes
    model_bound = max(weight_bytes(runner.model), CPU_KV_MIN_BYTES, sequence)
    assert cache_bytes <= model_bound
    # Other tests' processes come and go on this host: allow for twice the memory seen.
    assert cache_bytes <= max(2 * before * CPU_KV_AVAILABLE_SHARE, sequence)
    assert kv.cache.numel() * kv.cache.element_size() == cache_bytes
