"""Quantized KV caches, fp8 (e4m3) and int8: storage dtype, quantize/dequantize in torch,
per-layer scales.

A quantized cache stores `x / scale` saturated at the type's largest value: fp8
`clamp(x / scale, -448, 448)` rounded to `torch.float8_e4m3fn`, int8 `clamp(x / scale, -127, 127)`
rounded to the nearest integer (halves away from zero, as the Triton write kernels round);
readers multiply by the scale. Each layer has one K and one V scale (`[num_layers, 2]` float32).
fp8 defaults to 1.0 (what vLLM uses without calibration: e4m3 keeps ~2 significant digits
from 2**-9 to 448). int8 has a fixed step of `scale` across its whole range, so it needs scales
fitted to the activations (`scales_from_amax`, from a calibration pass or a file; see
engine/attention/kv_calibration.py), as TensorRT-LLM's INT8 KV cache takes them from its
calibration. The scales are constant for an engine's life, so the backends take them as Python
floats (baked into a CUDA graph at capture, no device reads).
"""

from __future__ import annotations

import torch

# The dtypes and saturation bounds are the kernels' (one definition, torch-only module).
from engine.kernels._checks import (
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    INT8_KV_DTYPE,
    INT8_KV_MAX,
    is_quantized_kv,
    kv_quant_max,
)

KV_CACHE_DTYPES = ("auto", "fp8", "int8")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for `CacheConfig.kv_cache_dtype` ("auto" = the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    if kv_cache_dtype == "int8":
        return INT8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                     f"got {kv_cache_dtype!r}")


def is_quantized(t: torch.Tensor) -> bool:
    """A one-byte cache (fp8 or int8) whose values are divided by per-layer scales."""
    return is_quantized_kv(t.dtype)


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x (any float dtype) → float8_e4m3fn of `x / scale` saturated to ±448 (math in float32;
    the same reciprocal-multiply as the Triton write kernel, so both round alike).

    scale: a float, or a tensor broadcastable against x (e.g. `[L, 2, 1, 1, 1, 1]`)."""
    y = x.float() * (1.0 / scale)
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def quantize_int8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x (any float dtype) → int8 of `x / scale` saturated to ±127 and rounded to the nearest
    integer, halves away from zero (the Triton write kernels' arithmetic, step for step:
    `trunc(y ± 0.5)` in float32, so a value within half an ulp below a half also rounds up)."""
    y = (x.float() * (1.0 / scale)).clamp_(-INT8_KV_MAX, INT8_KV_MAX)
    return (y + torch.where(y >= 0, 0.5, -0.5)).to(INT8_KV_DTYPE)  # the cast truncates


def quantize_kv(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """x → a quantized cache's values of `dtype` (fp8 or int8) under `scale`."""
    if dtype == INT8_KV_DTYPE:
        return quantize_int8(x, scale)
    if dtype == FP8_KV_DTYPE:
        return quantize_fp8(x, scale)
    raise ValueError(f"{dtype} is not a quantized KV cache dtype")


def dequantize_kv(x: torch.Tensor, scale: float | torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 or int8 x → `x * scale` in `dtype` (math in float32)."""
    return (x.float() * scale).to(dtype)


def default_kv_scales(num_layers: int) -> torch.Tensor:
    """Uncalibrated scales: `[num_layers, 2]` float32 ones (CPU)."""
    return torch.ones(num_layers, 2, dtype=torch.float32)


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-layer `[L, 2]` scales that map each layer's largest |K| and |V| (`amax [L, 2]`) to the
    type's largest stored value (TensorRT-LLM's `amax / 127` for int8; `amax / 448` for fp8).
    A layer that saw only zeros keeps 1.0 (any scale stores zeros exactly)."""
    if not is_quantized_kv(dtype):
        raise ValueError(f"{dtype} is not a quantized KV cache dtype")
    amax = amax.detach().float().cpu()
    scales = amax / kv_quant_max(dtype)
    return torch.where(amax > 0, scales, torch.ones_like(scales)).contiguous()
