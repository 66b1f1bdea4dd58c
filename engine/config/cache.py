"""The paged KV cache's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from engine_api.errors import ConfigError

BlockAllocation = Literal["auto", "lru", "runs"]
BLOCK_ALLOCATIONS: tuple[BlockAllocation, ...] = get_args(BlockAllocation)
KvCacheDtype = Literal["auto", "fp8", "int8"]


def kv_cache_dtype_name(name: str) -> str:
    """A KV cache dtype as vLLM names it (fp8_e4m3: the same e4m3 storage as "fp8") → this
    config's name; ConfigError for one the kernels do not store (fp8_e5m2)."""
    if name == "fp8_e4m3":
        return "fp8"
    if name == "fp8_e5m2":
        raise ConfigError("kv_cache_dtype fp8_e5m2 is not supported: the kernels store fp8 as "
                          "e4m3 (use fp8 or fp8_e4m3)")
    if name not in get_args(KvCacheDtype):
        raise ConfigError(f"kv_cache_dtype must be auto, fp8 (fp8_e4m3) or int8, got {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None   # None: sized by memory profiling
    gpu_memory_utilization: float = 0.85
    # KV budget when running on the CPU; None: sized from the model's weights and the host's
    # available memory (engine/runner/kv_sizing.py default_cpu_kv_bytes).
    cpu_kv_cache_bytes: int | None = None
    # "fp8": float8 e4m3 storage with per-layer K/V scales (half the bytes of bf16); "int8":
    # int8 storage with per-layer K/V scales from a calibration pass (engine/attention/
    # kv_calibration.py) and per-channel factors within them (kv_channels.py), for GPUs
    # without fp8 conversions (Ampere) or an int8 pipeline.
    kv_cache_dtype: KvCacheDtype = "auto"
    # Where a quantized cache's scales come from: None = the dtype's default (fp8: 1.0,
    # int8: "calibrate"), "calibrate" (a prefill of a fixed text at start-up), or the path of
    # a JSON file (`splitserve kv-scales` writes one).
    kv_scales: str | None = None
    tenant_salt: str = ""
    # Which free blocks are handed out: "lru" (least recently freed first), "runs" (prompts
    # kept in runs of consecutive ids, RunKeepingBlockPool: a KV handoff copies one run at a
    # time), "auto" (runs for the prefill and decode roles, whose prompts' KV is copied between
    # caches; lru for colocated engines).
    block_allocation: BlockAllocation = "auto"

    def validate(self) -> None:
        if self.block_allocation not in BLOCK_ALLOCATIONS:
            raise ConfigError(f"block_allocation must be one of {', '.join(BLOCK_ALLOCATIONS)}, "
                              f"got {self.block_allocation!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' (the model dtype), 'fp8' "
                              f"(float8 e4m3) or 'int8', got {self.kv_cache_dtype!r}")
        if self.kv_scales is not None and self.kv_cache_dtype == "auto":
            raise ConfigError("kv_scales applies to a quantized cache (kv_cache_dtype fp8 or "
                              "int8), not to 'auto'")
        if self.kv_scales is not None and not self.kv_scales.strip():
            raise ConfigError("kv_scales must be 'calibrate' or the path of a JSON file")
        if self.cpu_kv_cache_bytes is not None and (type(self.cpu_kv_cache_bytes) is not int
                                                    or self.cpu_kv_cache_bytes < 1):
            raise ConfigError(f"cpu_kv_cache_bytes must be an integer >= 1 (or unset: sized "
                              f"from the model and memory), got {self.cpu_kv_cache_bytes!r}")
        if self.num_gpu_blocks is not None and (type(self.num_gpu_blocks) is not int
                                                or self.num_gpu_blocks < 1):
            raise ConfigError(f"num_gpu_blocks must be an integer >= 1 (or unset: sized from "
                              f"memory), got {self.num_gpu_blocks!r}")
