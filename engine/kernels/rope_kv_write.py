"""Triton RoPE fused with the paged KV-cache write: `rotary_embedding` then `write_kv` in one launch.

Per token (one program each) this rotates all q heads in place, rotates all k heads in place and
stores the rotated k and the unchanged v in the token's cache slot. A decode step thus launches
one kernel per layer instead of two and reads k once. The results equal the two separate kernels
bit for bit: the rotation runs in float32 like rotary.py, and the cache receives the rotated k
after rounding to k's dtype (then quantized exactly as kv_write.py does for an fp8 or int8 cache).

Layouts are those of rotary.py (`cos_sin_cache [max_pos, D]`: cos | sin halves; neox or GPT-J
pairs) and kv_write.py (`kv_cache [2, num_blocks, block_size, Hkv, D]`, slot -1 = skip).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import check_devices, next_power_of_2
from engine.kernels._pdl import pdl_release, pdl_wait, use_pdl
from engine.kernels._tl import load_scale
from engine.kernels.kv_write import _store_to_cache, check_write_kv_args, store_args
from engine.kernels.rotary import _rotated_heads, check_rotary_args, load_cos_sin


# `positions` is a slice of the step's pinned buffer, 16-byte aligned only for an even token
# count: not specialised on, so odd and even steps share one compiled variant.
@triton.jit(do_not_specialize=["positions_ptr"])
def _rope_kv_write_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, H, D], tokens `stride_q` apart
    k_ptr,  # [T, Hkv, D], tokens `stride_k` apart
    v_ptr,  # [T, Hkv, D], tokens `stride_v` apart
    cos_sin_ptr,  # [max_pos, D] contiguous
    k_cache_ptr,  # [NB * BS, Hkv * D] (kv_cache[0] flattened)
    v_cache_ptr,  # [NB * BS, Hkv * D] (kv_cache[1] flattened)
    slot_mapping_ptr,  # [T] int64
    stride_q,
    stride_k,
    stride_v,
    k_scale,  # float32 scalar or pointer to one (SCALE_IS_PTR); read only when QUANT
    v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    Q_MAX: tl.constexpr,
    ROUND_INT: tl.constexpr,
    PRE_ROUND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # everything below reads what earlier kernels wrote
    pdl_release(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(positions_ptr, cos_sin_ptr, token, HALF)

    q_row = q_ptr + token * stride_q
    q1, q2, q_off1, q_off2, q_mask = _rotated_heads(q_row, cos, sin, NUM_HEADS, BLOCK_H, HALF,
                                                    IS_NEOX)
    tl.store(q_row + q_off1, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_row + q_off2, q2.to(q_ptr.dtype.element_ty), mask=q_mask)

    # Padding tokens (slot < 0) are rotated like any other, as rotary_embedding does.
    k_row = k_ptr + token * stride_k
    k1, k2, off1, off2, mask = _rotated_heads(k_row, cos, sin, NUM_KV_HEADS, BLOCK_HKV, HALF,
                                              IS_NEOX)
    # Round to k's dtype before caching: the cache holds what write_kv would read back from k.
    k1 = k1.to(k_ptr.dtype.element_ty)
    k2 = k2.to(k_ptr.dtype.element_ty)
    tl.store(k_row + off1, k1, mask=mask)
    tl.store(k_row + off2, k2, mask=mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        row = slot * (NUM_KV_HEADS * 2 * HALF)
        inv_ks = 1.0 / load_scale(k_scale, SCALE_IS_PTR)
        inv_vs = 1.0 / load_scale(v_scale, SCALE_IS_PTR)
        _store_to_cache(k_cache_ptr + row + off1, k1, inv_ks, mask, QUANT, Q_MAX, ROUND_INT,
                        PRE_ROUND)
        _store_to_cache(k_cache_ptr + row + off2, k2, inv_ks, mask, QUANT, Q_MAX, ROUND_INT,
                        PRE_ROUND)
        heads = tl.arange(0, BLOCK_HKV)[:, None]
        v_off = heads * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]  # [BLOCK_HKV, D]
        v_mask = heads < NUM_KV_HEADS
        v = tl.load(v_ptr + token * stride_v + v_off, mask=v_mask)
        _store_to_cache(v_cache_ptr + row + v_off, v, inv_vs, v_mask, QUANT, Q_MAX, ROUND_INT,
                        PRE_ROUND)


def rotary_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    is_neox: bool = True,
) -> None:
    """Rotate `q [T, H, D]` and `k [T, Hkv, D]` in place by `positions [T]`, then write the
    rotated k and `v [T, Hkv, D]` into `kv_cache` at `slot_mapping [T]` (int64, -1 = skip).

    Mutates q, k and kv_cache, exactly as `rotary_embedding(positions, q, k, cos_sin_cache,
    is_neox)` followed by `write_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)`, and takes
    what both take: q/k/v dense in their last two dims (a padded token stride, e.g. views of a
    fused QKV output, is fine), k/v in the cache's dtype (any float dtype for an fp8 or int8 cache),
    k_scale/v_scale only for an fp8 or int8 cache (floats or one-element float32 tensors; CUDA-graph
    capturable). Positions `< max_pos` and slots `< num_blocks * block_size` are not checked
    (that would need a host sync).
    """
    check_rotary_args(positions, q, k, cos_sin_cache)
    ks, vs = check_write_kv_args(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    check_devices(("q", "kv_cache"), (q, kv_cache))
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    pdl = use_pdl(q.device)
    _rope_kv_write_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        ks,
        vs,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_HKV=next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        IS_NEOX=bool(is_neox),
        SCALE_IS_PTR=isinstance(ks, torch.Tensor),
        **store_args(kv_cache.dtype),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
