"""Triton rotary position embedding (RoPE), applied in place to q and k.

`cos_sin_cache [max_pos, D]` holds cos in columns `[0, D/2)` and sin in `[D/2, D)`.
Neox style (Llama): pairs are `(x[i], x[i + D/2])`. GPT-J style: pairs are `(x[2i], x[2i+1])`.
Both rotate a pair `(x1, x2)` to `(x1*cos - x2*sin, x2*cos + x1*sin)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    POSITION_DTYPES,
    KernelInputError,
    check_contiguous,
    check_devices,
    check_head_dim,
    check_inner_dense,
    check_shape,
    check_tensor,
    next_power_of_2,
)


@triton.jit
def _rotated_heads(
    x_ptr,  # one token's [NUM_HEADS, D] slice, dense
    cos,  # [1, HALF] float32
    sin,  # [1, HALF] float32
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Load and rotate one token's heads in float32; returns `(o1, o2, off1, off2, mask)`, the
    rotated pair halves `[BLOCK_H, HALF]` and their offsets in a dense `[NUM_HEADS, D]` row (the
    same offsets address the token's cache row, which has that layout too)."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    idx = tl.arange(0, HALF)[None, :]  # [1, HALF]
    mask = heads < NUM_HEADS
    if IS_NEOX:
        off1 = heads * (2 * HALF) + idx
        off2 = off1 + HALF
    else:
        off1 = heads * (2 * HALF) + 2 * idx
        off2 = off1 + 1
    x1 = tl.load(x_ptr + off1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + off2, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, off1, off2, mask


@triton.jit
def _rotate_heads(
    x_ptr,  # one token's [NUM_HEADS, D] slice, dense
    cos,  # [1, HALF] float32
    sin,  # [1, HALF] float32
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    o1, o2, off1, off2, mask = _rotated_heads(x_ptr, cos, sin, NUM_HEADS, BLOCK_H, HALF, IS_NEOX)
    tl.store(x_ptr + off1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + off2, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_cos_sin(positions_ptr, cos_sin_ptr, token, HALF: tl.constexpr):
    """The `[1, HALF]` float32 cos and sin rows of `token`'s position."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    idx = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + idx).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + idx).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, H, D], tokens `stride_q` apart
    k_ptr,  # [T, Hkv, D], tokens `stride_k` apart
    cos_sin_ptr,  # [max_pos, D] contiguous
    stride_q,
    stride_k,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    # One program per token rotates all its q and k heads with one cos/sin row.
    token = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, HALF)
    _rotate_heads(q_ptr + token * stride_q, cos, sin, NUM_HEADS, BLOCK_H, HALF, IS_NEOX)
    _rotate_heads(k_ptr + token * stride_k, cos, sin, NUM_KV_HEADS, BLOCK_HKV, HALF, IS_NEOX)


def check_rotary_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """What `rotary_embedding` requires of its arguments (KernelInputError otherwise)."""
    positions = check_tensor("positions", positions, 1, POSITION_DTYPES)
    q = check_tensor("q", q, 3, FLOAT_DTYPES)
    k = check_tensor("k", k, 3, FLOAT_DTYPES)
    cos_sin_cache = check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    num_tokens, _, head_dim = q.shape
    check_head_dim("q", head_dim)
    check_shape("positions", positions, (num_tokens,))
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise KernelInputError(
            f"k must be [T={num_tokens}, Hkv, D={head_dim}], got {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise KernelInputError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    if cos_sin_cache.shape[1] != head_dim:
        raise KernelInputError(
            f"cos_sin_cache must be [max_pos, D={head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    check_inner_dense("q", q, 2)
    check_inner_dense("k", k, 2)
    check_contiguous("cos_sin_cache", cos_sin_cache)
    check_contiguous("positions", positions)
    check_devices(("q", "k", "positions", "cos_sin_cache"), (q, k, positions, cos_sin_cache))


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotate `q [T, H, D]` and `k [T, Hkv, D]` in place by `positions [T]` (int32/int64).

    Mutates q and k only. They must share a dtype and be dense in their last two dims (a padded
    token stride, e.g. a view of a fused QKV output, is fine). Positions must be `< max_pos`
    (not checked: that would need a host sync).
    """
    check_rotary_args(positions, q, k, cos_sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        k.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_HKV=next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        IS_NEOX=bool(is_neox),
        num_warps=4,
    )
