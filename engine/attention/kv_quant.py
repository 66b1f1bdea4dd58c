"""fp8 (e4m3) KV cache: storage dtype, quantize/dequantize in torch, per-layer scales.

A quantized cache stores `clamp(x / scale, -448, 448)` rounded to `torch.float8_e4m3fn`; readers
multiply by the scale. Each layer has one K and one V scale (`[num_layers, 2]` float32, 1.0 by
default as vLLM uses without calibration). The scales are constant for an engine's life, so the
backends take them as Python floats (baked into a CUDA graph at capture, no device reads).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # largest finite e4m3fn value: quantized values saturate here


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for `CacheConfig.kv_cache_dtype` ("auto" = the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_KV_DTYPE


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x (any float dtype) → float8_e4m3fn of `x / scale` saturated to ±448 (math in float32;
    the same reciprocal-multiply as the Triton write kernel, so both round alike).

    scale: a float, or a tensor broadcastable against x (e.g. `[L, 2, 1, 1, 1, 1]`)."""
    y = x.float() * (1.0 / scale)
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float | torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn x → `x * scale` in `dtype` (math in float32)."""
    return (x.float() * scale).to(dtype)


def default_kv_scales(num_layers: int) -> torch.Tensor:
    """Uncalibrated scales: `[num_layers, 2]` float32 ones (CPU)."""
    return torch.ones(num_layers, 2, dtype=torch.float32)


class KvScaleTable:
    """Per-layer (k_scale, v_scale) floats, looked up by a layer's cache tensor.

    The model calls a backend with one layer's cache `kv_cache[l]` but not its index, so the
    runner binds each layer view's `data_ptr()` to its scales once the cache exists. A cache that
    was never bound (the memory-profiling scratch cache) reads with scale 1.0.
    """

    def __init__(self) -> None:
        self._by_ptr: dict[int, tuple[float, float]] = {}

    def bind(self, layer_caches: list[torch.Tensor], scales: torch.Tensor) -> None:
        """layer_caches: per layer `[2, NB, BS, Hkv, D]`; scales: `[num_layers, 2]` float32."""
        if tuple(scales.shape) != (len(layer_caches), 2):
            raise ValueError(f"kv scales must be [{len(layer_caches)}, 2], got "
                             f"{tuple(scales.shape)}")
        values = scales.detach().float().cpu().tolist()
        for cache, (k, v) in zip(layer_caches, values, strict=True):
            if not (k > 0.0 and v > 0.0 and k < float("inf") and v < float("inf")):
                raise ValueError(f"kv scales must be positive and finite, got {k}, {v}")
            self._by_ptr[cache.data_ptr()] = (float(k), float(v))

    def lookup(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        return self._by_ptr.get(kv_cache.data_ptr(), (1.0, 1.0))
