"""Triton kernel writing this step's K/V into the paged cache (vLLM's reshape_and_cache).

Cache layout (one layer, contiguous)::

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             ^ 0 = K, 1 = V
    slot = block_id * block_size + offset  ->  kv_cache[i].view(-1, Hkv, D)[slot]

Because `[num_blocks, block_size]` is dense, a slot is a row index of the flattened cache, so
each token's `Hkv * D` values land in one contiguous run.

A quantized cache stores `x / scale` saturated at the type's largest value and rounded, with one
K and one V scale per layer (readers multiply back): fp8 (e4m3) `clamp(x / scale, -448, 448)`
rounded to the nearest fp8 value, int8 `clamp(x / scale, -127, 127)` rounded to the nearest
integer, halves away from zero. Other caches store `x` in the cache dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    INT8_KV_DTYPE,
    KernelInputError,
    KvScale,
    check_contiguous,
    check_devices,
    check_inner_dense,
    check_kv_cache,
    check_kv_scale,
    check_matches_cache,
    check_shape,
    check_tensor,
    interpret_mode,
    is_quantized_kv,
    kv_quant_max,
    next_power_of_2,
)
from engine.kernels._tl import load_scale, round_to_e4m3


@triton.jit
def _store_to_cache(
    dst_ptr,
    x,
    inv_scale,  # float32 1 / scale; used only when QUANT
    mask,
    QUANT: tl.constexpr,
    Q_MAX: tl.constexpr,
    ROUND_INT: tl.constexpr,
    PRE_ROUND: tl.constexpr,
):
    """Store `x` in the cache's dtype; a quantized cache gets `x / scale`, saturated at +-Q_MAX
    (and rounded to an integer first for int8: the float -> int cast truncates)."""
    if QUANT:
        # Multiply by the reciprocal (as the torch reference does) so both round alike.
        x = x.to(tl.float32) * inv_scale
        x = tl.minimum(tl.maximum(x, -Q_MAX), Q_MAX)
        if ROUND_INT:  # to nearest, halves away from zero, then the cast's truncation is exact
            x = x + tl.where(x >= 0.0, 0.5, -0.5)
        elif PRE_ROUND:  # interpreter only: its own fp8 cast rounds wrongly
            x = round_to_e4m3(x)
    tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


def store_args(cache_dtype: torch.dtype) -> dict[str, object]:
    """The compile-time arguments of `_store_to_cache` for a cache of `cache_dtype` (every
    eager KV write asks: built once per dtype and mode; callers unpack, never mutate)."""
    return _store_args(cache_dtype, interpret_mode())


@functools.lru_cache(maxsize=16)
def _store_args(cache_dtype: torch.dtype, interpreted: bool) -> dict[str, object]:
    quant = is_quantized_kv(cache_dtype)
    return {
        "QUANT": quant,
        "Q_MAX": kv_quant_max(cache_dtype) if quant else 0.0,
        "ROUND_INT": cache_dtype == INT8_KV_DTYPE,
        "PRE_ROUND": quant and cache_dtype != INT8_KV_DTYPE and interpreted,
    }


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D], rows `stride_key_t` apart
    value_ptr,  # [T, Hkv, D], rows `stride_value_t` apart
    k_cache_ptr,  # [NB * BS, Hkv * D] (kv_cache[0] flattened)
    v_cache_ptr,  # [NB * BS, Hkv * D] (kv_cache[1] flattened)
    slot_mapping_ptr,  # [T] int64
    stride_key_t,
    stride_value_t,
    k_scale,  # float32 scalar or pointer to one (SCALE_IS_PTR); read only when QUANT
    v_scale,
    ROW: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,  # next power of two >= ROW
    QUANT: tl.constexpr,  # quantized cache: divide by the scale and saturate before the cast
    SCALE_IS_PTR: tl.constexpr,
    Q_MAX: tl.constexpr,
    ROUND_INT: tl.constexpr,
    PRE_ROUND: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token.to(tl.int64) * stride_key_t + offs, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_value_t + offs, mask=mask)
    dst = slot * ROW + offs
    inv_ks = 1.0 / load_scale(k_scale, SCALE_IS_PTR)
    inv_vs = 1.0 / load_scale(v_scale, SCALE_IS_PTR)
    _store_to_cache(k_cache_ptr + dst, k, inv_ks, mask, QUANT, Q_MAX, ROUND_INT, PRE_ROUND)
    _store_to_cache(v_cache_ptr + dst, v, inv_vs, mask, QUANT, Q_MAX, ROUND_INT, PRE_ROUND)


def check_write_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> tuple[KvScale, KvScale]:
    """What `write_kv` requires of its arguments (KernelInputError otherwise); returns the
    K and V scales to pass to a kernel (1.0 for None)."""
    _, _, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    key = check_tensor("key", key, 3, FLOAT_DTYPES)
    value = check_tensor("value", value, 3, FLOAT_DTYPES)
    slot_mapping = check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens = key.shape[0]
    for name, t in (("key", key), ("value", value)):
        check_shape(name, t, (num_tokens, num_kv_heads, head_dim))
        check_matches_cache(name, t, kv_cache.dtype)
        check_inner_dense(name, t, 2)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_contiguous("slot_mapping", slot_mapping)
    ks = check_kv_scale("k_scale", k_scale, kv_cache.dtype, kv_cache.device)
    vs = check_kv_scale("v_scale", v_scale, kv_cache.dtype, kv_cache.device)
    if isinstance(ks, torch.Tensor) != isinstance(vs, torch.Tensor):
        raise KernelInputError("k_scale and v_scale must both be floats or both be tensors")
    check_devices(
        ("kv_cache", "key", "value", "slot_mapping"), (kv_cache, key, value, slot_mapping)
    )
    return ks, vs


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into `kv_cache` at `slot_mapping [T]` (int64, -1 = skip).

    Mutates `kv_cache` only. `key`/`value` must have the cache's dtype (any float dtype for an
    fp8 or int8 cache) and be dense in their last two dims (a padded token stride, e.g. a view of a fused
    QKV output, is fine). Slots must be `< num_blocks * block_size` (not checked: that would need
    a host sync). k_scale/v_scale (fp8 or int8 cache only; None = 1.0): Python floats, or one-element
    float32 tensors on the cache's device read by the kernel — either way CUDA-graph capturable.
    """
    ks, vs = check_write_kv_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ks,
        vs,
        ROW=row,
        BLOCK=next_power_of_2(row),
        SCALE_IS_PTR=isinstance(ks, torch.Tensor),
        **store_args(kv_cache.dtype),
        num_warps=4 if row >= 512 else 1,
    )
