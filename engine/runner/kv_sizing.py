"""How many KV blocks an engine's cache gets: a CPU engine's byte budget (given, or sized from
the model and the host's available memory), or a GPU's memory left after a worst-case forward
pass. Rank 0 and every tensor-parallel worker size their share alike (the engine keeps the
smallest).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import ConfigError, EngineConfig
from engine.penalties import PenaltyState

logger = logging.getLogger(__name__)


# An unset CPU budget takes at most this share of the memory available when the engine starts:
# two workers and a gateway of `splitserve up` share one host, and the cache is allocated (and
# zeroed, so resident) up front.
CPU_KV_AVAILABLE_SHARE = 0.1
# ... and at least this much where memory allows, whatever the model's size: a tiny model's
# weights would otherwise leave room for a handful of sequences.
CPU_KV_MIN_BYTES = 256 << 20


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the host's MemAvailable, lowered to the room left
    under a cgroup (v2) limit when one is set (a container's limit, not the host's memory);
    None where neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def default_cpu_kv_bytes(weight_bytes: int, sequence_bytes: int, available: int | None) -> int:
    """A CPU engine's KV budget when none is given: as many bytes as the model's weights (a
    cache of that size already holds far more tokens than a CPU computes at once; at least
    CPU_KV_MIN_BYTES), at most CPU_KV_AVAILABLE_SHARE of the available memory, and at least one
    sequence at full length (`sequence_bytes`), so the longest prompt the engine accepts fits."""
    budget = max(weight_bytes, CPU_KV_MIN_BYTES)
    if available is not None:
        budget = min(budget, int(available * CPU_KV_AVAILABLE_SHARE))
    if budget < sequence_bytes:
        logger.warning("little memory available (%s): the CPU KV cache holds one sequence at "
                       "full length, %.0f MiB", "unknown" if available is None
                       else f"{available / 2**20:.0f} MiB", sequence_bytes / 2**20)
    return max(budget, sequence_bytes)


def cpu_kv_blocks(config: EngineConfig, block_bytes: int, max_model_len: int,
                  weight_bytes: int) -> int:
    """KV blocks of `block_bytes` a CPU engine holds: its byte budget (`cpu_kv_cache_bytes`, or
    `default_cpu_kv_bytes` of this rank's `weight_bytes` when unset), capped at every sequence
    at full length."""
    blocks_per_seq = -(-max_model_len // config.cache.block_size)
    budget = config.cache.cpu_kv_cache_bytes
    if budget is None:
        budget = default_cpu_kv_bytes(weight_bytes, (blocks_per_seq + 1) * block_bytes,
                                      available_memory_bytes())
        logger.info("CPU KV cache: %.0f MiB (sized from the model and the available memory; "
                    "--cpu-kv-cache-gb sets it)", budget / 2**20)
    n = budget // block_bytes
    cap = config.scheduler.max_num_seqs * blocks_per_seq + 1
    return max(1, min(n, cap))


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (this rank's share of the model)."""
    return sum(t.numel() * t.element_size()
               for t in (*module.parameters(), *module.buffers()))


def gpu_kv_blocks(config: EngineConfig, device: torch.device, peak: int, block_bytes: int,
                  vocab_size: int) -> int:
    """KV blocks of `block_bytes` that fit the device once a worst-case forward peaked at
    `peak` bytes."""
    total = torch.cuda.get_device_properties(device).total_memory
    # Headroom for CUDA graphs' pools and the allocator's fragmentation, and the sampler's
    # penalty history, which grows as penalized requests arrive up to one slot per running
    # request (engine/penalties.py): kept out of the cache before it can be needed.
    reserve = 2 << 30 if not config.runner.enforce_eager else 512 << 20
    reserve += PenaltyState.bytes_for(config.scheduler.max_num_seqs, vocab_size)
    budget = int(total * config.cache.gpu_memory_utilization) - peak - reserve
    # The share above assumes this process's tensors are the device's only users; memory
    # held elsewhere (another process, an engine of this one not yet freed) must not be
    # promised to the cache, or allocating it fails outright.
    free, _ = torch.cuda.mem_get_info(device)
    if budget > free - reserve:
        logger.warning("GPU memory in use elsewhere: %.1f GiB free of %.1f GiB; the KV cache "
                       "gets %.1f GiB instead of %.1f GiB", free / 2**30, total / 2**30,
                       max(0, free - reserve) / 2**30, budget / 2**30)
        budget = free - reserve
    if budget < block_bytes * 16:
        raise ConfigError("not enough GPU memory for the KV cache; lower max_num_batched_tokens "
                          "or raise gpu_memory_utilization")
    return budget // block_bytes
