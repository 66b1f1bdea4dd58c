"""Triton kernel writing this step's K/V into the paged cache (vLLM's reshape_and_cache).

Cache layout (one layer, contiguous)::

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             ^ 0 = K, 1 = V
    slot = block_id * block_size + offset  ->  kv_cache[i].view(-1, Hkv, D)[slot]

Because `[num_blocks, block_size]` is dense, a slot is a row index of the flattened cache, so
each token's `Hkv * D` values land in one contiguous run.

An fp8 (e4m3) cache stores `clamp(x / scale, -448, 448)` rounded to fp8, with one K and one V
scale per layer (readers multiply back); other caches store `x` in the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    KernelInputError,
    check_devices,
    check_inner_dense,
    check_kv_cache,
    check_kv_scale,
    check_matches_cache,
    check_shape,
    check_tensor,
    interpret_mode,
    next_power_of_2,
)
from engine.kernels._tl import load_scale, round_to_e4m3


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
    QUANT: tl.constexpr,  # fp8 cache: divide by the scale and saturate before the cast
    SCALE_IS_PTR: tl.constexpr,
    FP8_MAX: tl.constexpr,
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
    if QUANT:
        # Multiply by the reciprocal (as the torch reference does) so both round alike.
        k = k.to(tl.float32) * (1.0 / load_scale(k_scale, SCALE_IS_PTR))
        v = v.to(tl.float32) * (1.0 / load_scale(v_scale, SCALE_IS_PTR))
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
        if PRE_ROUND:  # interpreter only: its own fp8 cast rounds wrongly
            k = round_to_e4m3(k)
            v = round_to_e4m3(v)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
    fp8 cache) and be dense in their last two dims (a padded token stride, e.g. a view of a fused
    QKV output, is fine). Slots must be `< num_blocks * block_size` (not checked: that would need
    a host sync). k_scale/v_scale (fp8 cache only; None = 1.0): Python floats, or one-element
    float32 tensors on the cache's device read by the kernel — either way CUDA-graph capturable.
    """
    _, _, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    key = check_tensor("key", key, 3, FLOAT_DTYPES)
    value = check_tensor("value", value, 3, FLOAT_DTYPES)
    slot_mapping = check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens = key.shape[0]
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    for name, t in (("key", key), ("value", value)):
        check_matches_cache(name, t, kv_cache.dtype)
        check_inner_dense(name, t, 2)
    ks = check_kv_scale("k_scale", k_scale, kv_cache.dtype, kv_cache.device)
    vs = check_kv_scale("v_scale", v_scale, kv_cache.dtype, kv_cache.device)
    if isinstance(ks, torch.Tensor) != isinstance(vs, torch.Tensor):
        raise KernelInputError("k_scale and v_scale must both be floats or both be tensors")
    if not slot_mapping.is_contiguous():
        raise KernelInputError("slot_mapping must be contiguous")
    check_devices(
        ("kv_cache", "key", "value", "slot_mapping"), (kv_cache, key, value, slot_mapping)
    )
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
        QUANT=kv_cache.dtype == FP8_KV_DTYPE,
        SCALE_IS_PTR=isinstance(ks, torch.Tensor),
        FP8_MAX=FP8_E4M3_MAX,
        PRE_ROUND=interpret_mode(),
        num_warps=4 if row >= 512 else 1,
    )
