"""Triton kernel writing this step's K/V into the paged cache (vLLM's reshape_and_cache).

Cache layout (one layer, contiguous)::

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             ^ 0 = K, 1 = V
    slot = block_id * block_size + offset  ->  kv_cache[i].view(-1, Hkv, D)[slot]

Because `[num_blocks, block_size]` is dense, a slot is a row index of the flattened cache, so
each token's `Hkv * D` values land in one contiguous run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_devices,
    check_inner_dense,
    check_kv_cache,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D], rows `stride_key_t` apart
    value_ptr,  # [T, Hkv, D], rows `stride_value_t` apart
    k_cache_ptr,  # [NB * BS, Hkv * D] (kv_cache[0] flattened)
    v_cache_ptr,  # [NB * BS, Hkv * D] (kv_cache[1] flattened)
    slot_mapping_ptr,  # [T] int64
    stride_key_t,
    stride_value_t,
    ROW: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,  # next power of two >= ROW
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into `kv_cache` at `slot_mapping [T]` (int64, -1 = skip).

    Mutates `kv_cache` only. `key`/`value` must have the cache's dtype and be dense in their last
    two dims (a padded token stride, e.g. a view of a fused QKV output, is fine). Slots must be
    `< num_blocks * block_size` (not checked: that would need a host sync).
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
        if t.dtype != kv_cache.dtype:
            raise KernelInputError(
                f"{name} has dtype {t.dtype} but kv_cache has {kv_cache.dtype}; they must match"
            )
        check_inner_dense(name, t, 2)
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
        ROW=row,
        BLOCK=next_power_of_2(row),
        num_warps=4 if row >= 512 else 1,
    )
