"""The inner step shared by the paged attention kernels: attend one query tile to one KV tile.

The KV tile is `BLOCK_N` consecutive *positions* of one sequence, gathered token by token
through the block table (so the tile size is independent of the cache block size):

    pos  = n0 + [0, BLOCK_N)
    slot = block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    K    = k_cache[slot, kv_head, :]            # [BLOCK_N, HEAD_DIM], each row contiguous

Online softmax in the log2 domain (FlashAttention-2): scores are multiplied by
`qk_scale = scale * log2(e)` and exponentiated with exp2; `m_i` is the running row max,
`l_i` the running row sum, `acc` the unnormalised output, all float32.

An fp8 cache's tiles are converted to q's dtype after the load (exact: every e4m3 value is a
bf16/fp16/fp32 value); the callers fold the K scale into `qk_scale` and multiply the output by
the V scale, so the tile step itself never sees a scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import interpret_mode
from engine.kernels._tl import reduce_max, reduce_sum

LOG2E = 1.4426950408889634


@triton.jit
def attend_kv_tile(
    acc,  # [M, HEAD_DIM] float32
    l_i,  # [M] float32
    m_i,  # [M] float32
    q,  # [M, HEAD_DIM] in q's dtype (the cache dtype, unless the cache is fp8)
    q_pos,  # [M] int32: KV position of each query row (only read when CAUSAL)
    n0,  # first KV position of this tile
    kv_limit,  # positions >= kv_limit are masked (only read when BOUNDS_MASK)
    block_table_ptr,  # this sequence's row of the block table
    k_head_ptr,  # k_cache + kv_head * HEAD_DIM
    v_head_ptr,  # v_cache + kv_head * HEAD_DIM
    qk_scale,
    stride_cache_block,
    stride_cache_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BOUNDS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (Triton 3.9)
):
    pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    dims = tl.arange(0, HEAD_DIM)
    if BOUNDS_MASK:
        in_bounds = pos < kv_limit
        block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_bounds, other=0)
    else:
        block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE)
    # int64: block_id * stride overflows int32 on large caches.
    tok_off = block_ids.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_tok
    kv_off = tok_off[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
    if BOUNDS_MASK:
        k = tl.load(k_head_ptr + kv_off, mask=in_bounds[:, None], other=0.0)
    else:
        k = tl.load(k_head_ptr + kv_off)
    k = k.to(q.dtype)  # fp8 cache -> q's dtype; a no-op when they match
    if UPCAST_DOT:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
    if CAUSAL:
        visible = pos[None, :] <= q_pos[:, None]
        if BOUNDS_MASK:
            visible = visible & in_bounds[None, :]
        s = tl.where(visible, s, float("-inf"))
    elif BOUNDS_MASK:
        s = tl.where(in_bounds[None, :], s, float("-inf"))
    # Every caller guarantees each real row sees >= 1 position in its first tile, so m_new is
    # finite for real rows from then on and exp2(-inf - m_new) = 0 for masked entries.
    m_new = tl.maximum(m_i, reduce_max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + reduce_sum(p, 1)
    if BOUNDS_MASK:
        v = tl.load(v_head_ptr + kv_off, mask=in_bounds[:, None], other=0.0)
    else:
        v = tl.load(v_head_ptr + kv_off)
    v = v.to(q.dtype)
    if UPCAST_DOT:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs (Triton would default to tf32); tf32 is ignored for 16-bit."""
    return "ieee" if dtype == torch.float32 or upcast_dots(dtype) else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether to run the dots in fp32: only for bf16 under the interpreter, whose bf16
    `tl.dot` returns garbage (seen with Triton 3.9); the GPU path keeps bf16 tensor-core dots."""
    return dtype == torch.bfloat16 and interpret_mode()
