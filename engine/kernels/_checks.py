"""Input validation shared by the Triton wrappers (torch only, no Triton import).

Every wrapper validates shapes, dtypes, strides and devices on the host *before* launching, so a
bad call is a `KernelInputError` naming the argument and what is allowed, never a garbled kernel
or an illegal memory access. None of these checks reads tensor data (no host-device sync), so the
wrappers stay CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
# KV caches may also hold one byte per value, fp8 e4m3 or int8: values stored divided by a
# per-layer scale (see `check_kv_scale`), saturated at the type's largest value.
FP8_KV_DTYPE = torch.float8_e4m3fn
INT8_KV_DTYPE = torch.int8
QUANT_KV_DTYPES: tuple[torch.dtype, ...] = (FP8_KV_DTYPE, INT8_KV_DTYPE)
KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, *QUANT_KV_DTYPES)
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn: quantized values saturate here
INT8_KV_MAX = 127.0  # symmetric int8: -128 is never stored, so -x quantizes to -q(x)
INDEX_DTYPES_32: tuple[torch.dtype, ...] = (torch.int32,)
POSITION_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


class KernelInputError(ValueError):
    """A kernel argument has the wrong shape, dtype, stride or device; the message says which."""


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_capability_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether `device` is a CUDA GPU of compute capability `capability` or newer. Kernel
    launches ask this, so the capability is read once per device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= capability


@functools.lru_cache(maxsize=16)
def _cuda_capability(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return int(major), int(minor)


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Sequence[torch.dtype],
) -> torch.Tensor:
    """Check that `t` is a tensor of rank `ndim` with a dtype in `dtypes`; return it typed."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise KernelInputError(f"{name} has dtype {t.dtype}; allowed: {allowed}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    """Check an exact shape."""
    if tuple(t.shape) != tuple(expected):
        raise KernelInputError(
            f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Check the tensor is contiguous (the kernels compute addresses from a dense layout)."""
    if not t.is_contiguous():
        raise KernelInputError(
            f"{name} must be contiguous, got strides {tuple(t.stride())} for shape "
            f"{tuple(t.shape)}"
        )


def check_weight_scale(weight_scale: object, rows: int) -> torch.Tensor:
    """The float32 per-row scale `[rows]` of an int8 weight (contiguous)."""
    weight_scale = check_tensor("weight_scale", weight_scale, 1, (torch.float32,))
    if weight_scale.shape[0] != rows or not weight_scale.is_contiguous():
        raise KernelInputError(f"weight_scale must be a contiguous float32 [{rows}], got shape "
                               f"{tuple(weight_scale.shape)}")
    return weight_scale


def check_inner_dense(name: str, t: torch.Tensor, dense_dims: int) -> None:
    """Check the last `dense_dims` dims are densely packed; the leading stride may be anything.

    This admits views such as `qkv[:, :q_size].view(T, H, D)` whose token stride is larger
    than `H * D`, which the kernels take as a runtime stride.
    """
    expected = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - dense_dims, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            raise KernelInputError(
                f"{name} must be dense in its last {dense_dims} dimension(s) (only the leading "
                f"stride may be padded), got strides {tuple(t.stride())} for shape "
                f"{tuple(t.shape)}"
            )
        expected *= t.shape[dim]


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Check all tensors share one dtype."""
    first = tensors[0].dtype
    for name, t in zip(names[1:], tensors[1:], strict=True):
        if t.dtype != first:
            raise KernelInputError(
                f"{name} has dtype {t.dtype} but {names[0]} has {first}; they must match"
            )


def check_devices(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Check all tensors live on one device, a CUDA one unless Triton interprets on the CPU."""
    first = tensors[0].device
    for name, t in zip(names, tensors, strict=True):
        if t.device != first:
            raise KernelInputError(
                f"{name} is on {t.device} but {names[0]} is on {first}; all must share a device"
            )
    if first.type != "cuda" and not interpret_mode():
        raise KernelInputError(
            f"Triton kernels need CUDA tensors (got {first}); use the torch reference backend "
            "on CPU, or set TRITON_INTERPRET=1 to run the kernels in the interpreter"
        )


def check_head_dim(name: str, head_dim: int) -> None:
    """Head dims are powers of two in [16, 256] (tile widths are compile-time constants)."""
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1) != 0:
        raise KernelInputError(
            f"{name} head_dim is {head_dim}; allowed: a power of two in 16..256"
        )


def check_positive_int(name: str, value: object) -> int:
    """Check a Python int >= 1 (a host-side bound; never read from a device tensor)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KernelInputError(f"{name} must be a Python int >= 1, got {value!r}")
    return value


def check_window(value: object) -> int:
    """Check a sliding window: a Python int >= 0 (0: none), a per-layer constant."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KernelInputError(f"sliding_window must be a Python int >= 0, got {value!r}")
    return value


def check_softcap(value: object) -> float:
    """Check a logit soft cap: a finite Python number >= 0 (0: none)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0.0 <= float(value) < float("inf")):
        raise KernelInputError(f"logit_softcap must be a finite Python float >= 0, got {value!r}")
    return float(value)


def check_scale(scale: object) -> float:
    """Check the softmax scale is a positive finite Python number."""
    if isinstance(value := scale, bool) or not isinstance(value, int | float):
        raise KernelInputError(f"scale must be a Python float, got {type(scale).__name__}")
    fscale = float(value)
    if not (fscale > 0.0 and fscale < float("inf")):
        raise KernelInputError(f"scale must be positive and finite, got {fscale}")
    return fscale


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def check_kv_cache(kv_cache: object) -> tuple[int, int, int, int]:
    """Check one layer's cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`.

    Returns `(num_blocks, block_size, num_kv_heads, head_dim)`.
    """
    cache = check_tensor("kv_cache", kv_cache, 5, KV_CACHE_DTYPES)
    if cache.shape[0] != 2:
        raise KernelInputError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"(0 = K, 1 = V), got shape {tuple(cache.shape)}"
        )
    check_contiguous("kv_cache", cache)
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    check_head_dim("kv_cache", head_dim)
    if num_blocks < 1 or block_size < 1 or num_kv_heads < 1:
        raise KernelInputError(f"kv_cache has an empty dimension: shape {tuple(cache.shape)}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    """Query heads must split evenly into KV head groups."""
    if num_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )


def check_out(
    out: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Check a caller-provided output buffer: exact shape, dtype, device, contiguous."""
    o = check_tensor("out", out, len(shape), (dtype,))
    check_shape("out", o, shape)
    check_contiguous("out", o)
    if o.device != device:
        raise KernelInputError(f"out is on {o.device}, inputs are on {device}")
    return o


def is_quantized_kv(cache_dtype: torch.dtype) -> bool:
    """A one-byte cache (fp8 or int8) holding values divided by per-layer scales."""
    return cache_dtype in QUANT_KV_DTYPES


def kv_quant_max(cache_dtype: torch.dtype) -> float:
    """The largest value a quantized cache stores (saturation bound of `x / scale`)."""
    return INT8_KV_MAX if cache_dtype == INT8_KV_DTYPE else FP8_E4M3_MAX


def check_matches_cache(name: str, t: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """`t` (q, key or value) must have the cache's dtype, unless the cache is quantized (fp8 or
    int8): then any of fp32/fp16/bf16 (the kernel converts on store / load)."""
    if is_quantized_kv(cache_dtype):
        if t.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
            raise KernelInputError(
                f"{name} has dtype {t.dtype}; with a {cache_dtype} kv_cache allowed: {allowed}"
            )
    elif t.dtype != cache_dtype:
        raise KernelInputError(
            f"{name} has dtype {t.dtype} but kv_cache has {cache_dtype}; they must match "
            "(only an fp8 or int8 kv_cache takes another dtype)"
        )


KvScale = float | torch.Tensor


def check_kv_scale(
    name: str, scale: object, cache_dtype: torch.dtype, device: torch.device
) -> KvScale:
    """Check a K or V cache scale: None (= 1.0), a positive finite Python float, or a float32
    tensor of one element on the cache's device (read by the kernel: no host sync, so a CUDA
    graph replays whatever value it holds). Only a quantized (fp8 or int8) cache takes a scale
    other than None.

    Returns the float or the tensor (the tensor is not read on the host)."""
    if scale is None:
        return 1.0
    if not is_quantized_kv(cache_dtype):
        raise KernelInputError(
            f"{name} is only allowed with an fp8 or int8 kv_cache (got a {cache_dtype} cache); "
            "pass None"
        )
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise KernelInputError(
                f"{name} must be a float32 tensor of one element, got {scale.dtype} of shape "
                f"{tuple(scale.shape)}"
            )
        if scale.device != device:
            raise KernelInputError(f"{name} is on {scale.device}, kv_cache is on {device}")
        return scale
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise KernelInputError(
            f"{name} must be a Python float or a one-element tensor, got {type(scale).__name__}"
        )
    value = float(scale)
    if not (value > 0.0 and value < float("inf")):
        raise KernelInputError(f"{name} must be positive and finite, got {value}")
    return value
