"""How many KV blocks an engine's cache gets: a CPU engine's byte budget, or a GPU's memory left
after a worst-case forward pass. Rank 0 and every tensor-parallel worker size their share alike
(the engine keeps the smallest).
"""

from __future__ import annotations

import logging

import torch

from engine.config import ConfigError, EngineConfig
from engine.penalties import PenaltyState

logger = logging.getLogger(__name__)


def cpu_kv_blocks(config: EngineConfig, block_bytes: int, max_model_len: int) -> int:
    """KV blocks of `block_bytes` a CPU engine holds: its byte budget, capped at every sequence
    at full length."""
    n = config.cache.cpu_kv_cache_bytes // block_bytes
    cap = config.scheduler.max_num_seqs * (-(-max_model_len // config.cache.block_size)) + 1
    return max(1, min(n, cap))


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
