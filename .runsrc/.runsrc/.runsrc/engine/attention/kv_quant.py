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
    return is_fp8_dtype(t.dtype)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


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
