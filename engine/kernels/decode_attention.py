"""Triton paged decode attention: one query token per sequence, split-K (flash-decoding).

Pass 1 runs one program per `(sequence, kv_head, split)`. It takes all `GROUP = H / Hkv` query
heads that share the KV head as one `[BLOCK_G, D]` matrix (padded to 16 rows for `tl.dot`), so
each K/V tile is read once per group, and walks its split's slice of the sequence. A split's
slice is `ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N` positions, computed on the device
from `seq_lens`, so every sequence uses all splits and the host never reads `seq_lens`.

With `num_splits == 1` pass 1 normalises and writes the output directly. Otherwise it writes
partial results per split::

    mid_m   [B, H, S]     running max of scaled scores (log2 domain)
    mid_l   [B, H, S]     sum of exp2(score - max)
    mid_acc [B, H, S, D]  unnormalised sum of p * V (float32)

and pass 2 (one program per `(sequence, head)`) rescales the splits to a common max and
divides. An empty split (or `seq_len == 0`) has max -inf and weight 0; a sequence with
`seq_len == 0` (CUDA-graph padding) gets a zero output.

An fp8 cache holds K/V divided by per-layer scales: the K scale is folded into `qk_scale` and
each split's `acc` is multiplied by the V scale (softmax weights are unaffected by either).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._attention_tile import LOG2E, attend_kv_tile, dot_precision, upcast_dots
from engine.kernels._checks import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    INDEX_DTYPES_32,
    KernelInputError,
    KvScale,
    check_devices,
    check_gqa,
    check_inner_dense,
    check_kv_cache,
    check_kv_scale,
    check_matches_cache,
    check_out,
    check_positive_int,
    check_scale,
    check_shape,
    check_tensor,
    interpret_mode,
    next_power_of_2,
)
from engine.kernels._tl import ceil_div, load_scale, reduce_max, reduce_sum

# Measured on an H200 (Llama-3.1-8B shapes, CUDA graphs): splits of 64 positions still pay off
# for a lone 1k sequence; 32 splits cover a lone 8k one.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 32
DEFAULT_NUM_SMS = 132  # H100/H200 SXM


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] contiguous (written when DIRECT)
    mid_acc_ptr,  # [B, H, S, D] float32 (written unless DIRECT)
    mid_m_ptr,  # [B, H, S] float32
    mid_l_ptr,  # [B, H, S] float32
    qk_scale,
    k_scale,  # fp8 cache: float32 scalar or pointer to one (SCALE_IS_PTR)
    v_scale,
    num_heads,
    num_splits,
    stride_q_b,
    stride_q_h,
    stride_bt_b,
    stride_cache_block,
    stride_cache_tok,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = ceil_div(ceil_div(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g  # [BLOCK_G]
    g_mask = g < GROUP
    q_off = seq.to(tl.int64) * stride_q_b + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]
    if KV_FP8:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_IS_PTR)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
    v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        acc, l_i, m_i = attend_kv_tile(
            acc, l_i, m_i, q, g, n0, end, block_table_ptr, k_head_ptr, v_head_ptr, qk_scale,
            stride_cache_block, stride_cache_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
            True, False, DOT_PRECISION, UPCAST_DOT,
        )
    if KV_FP8:
        acc = acc * load_scale(v_scale, SCALE_IS_PTR)

    row = seq.to(tl.int64) * num_heads + heads  # [BLOCK_G] index into [B, H]
    if DIRECT:
        # l_i == 0 only for seq_len == 0, where acc == 0 too: the output is zeros.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        mid = row * num_splits + split  # [BLOCK_G] index into [B, H, S]
        tl.store(mid_m_ptr + mid, m_i, mask=g_mask)
        tl.store(mid_l_ptr + mid, l_i, mask=g_mask)
        tl.store(mid_acc_ptr + mid[:, None] * HEAD_DIM + dims[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    mid_acc_ptr,  # [B, H, S, D] float32
    mid_m_ptr,  # [B, H, S]
    mid_l_ptr,  # [B, H, S]
    out_ptr,  # [B, H, D]
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * num_heads + tl.program_id(1)  # index into [B, H]
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    s_mask = splits < num_splits
    mid = row * num_splits + splits
    m = tl.load(mid_m_ptr + mid, mask=s_mask, other=float("-inf"))
    l_s = tl.load(mid_l_ptr + mid, mask=s_mask, other=0.0)
    m_max = reduce_max(m, 0)
    # Empty splits (m = -inf) weigh exp2(-inf) = 0; when all are empty (seq_len == 0) m_max is
    # -inf too, so subtract 0 instead to avoid -inf - -inf = NaN.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.exp2(m - m_max)  # [BLOCK_S]
    total = reduce_sum(w * l_s, 0)
    acc = tl.load(mid_acc_ptr + mid[:, None] * HEAD_DIM + dims[None, :], mask=s_mask[:, None],
                  other=0.0)
    o = reduce_sum(acc * w[:, None], 0)  # [D]
    o = o / tl.where(total > 0.0, total, 1.0)  # total == 0 only when o == 0 (seq_len == 0)
    tl.store(out_ptr + row * HEAD_DIM + dims, o.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached host query), else the H200's 132."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _num_sms(index)
    return DEFAULT_NUM_SMS


def choose_num_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS
) -> int:
    """Splits per sequence: none once `B * Hkv` programs give two per SM, else about four
    programs per SM.

    Pure function of host-side ints (never of `seq_lens`), so a CUDA graph captured for a batch
    bucket and a `max_seq_len` bound replays with the same grid. Each split keeps at least
    `MIN_TOKENS_PER_SPLIT` positions of the longest possible sequence.
    """
    programs = max(1, batch_size * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    wanted = triton.cdiv(4 * num_sms, programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """Compile-time KV tile length and launch parameters of the split kernel."""

    block_n: int
    num_warps: int
    num_stages: int


def choose_decode_tiles(head_dim: int) -> DecodeTiles:
    """KV tile of 64 positions (32 for D=256) on the GPU, 3-stage pipelined (best of a sweep on
    an H200); 16 in the interpreter, whose cost is per element."""
    if interpret_mode():
        return DecodeTiles(16, 1, 1)
    if head_dim <= 128:
        return DecodeTiles(64, 4, 3)
    return DecodeTiles(32, 4, 2)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV; returns `out [B, H, D]`.

    q: `[B, H, D]` (dense in its last two dims), dtype = kv_cache dtype (fp32/fp16/bf16 when the
    cache is fp8).
    kv_cache: `[2, NB, BS, Hkv, D]` contiguous, already holding this step's K/V.
    k_scale/v_scale: fp8 cache only (None = 1.0): the stored values times these are K and V;
    Python floats or one-element float32 tensors on the cache's device.
    block_tables: `[B, max_blocks]` int32; seq_lens: `[B]` int32 (KV length incl. this token).
    out: optional contiguous `[B, H, D]` buffer in q's dtype (written entirely, returned).
    num_splits: force the split count; by default chosen from `max_seq_len` (a host int bound
    on `seq_lens`, default `max_blocks * BS`) and the batch size to fill the GPU.
    Mutates only `out`. No host syncs: CUDA-graph capturable for fixed shapes and bounds.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    q = check_tensor("q", q, 3, FLOAT_DTYPES)
    check_matches_cache("q", q, kv_cache.dtype)
    batch, num_heads = q.shape[0], q.shape[1]
    check_shape("q", q, (batch, num_heads, head_dim))
    check_inner_dense("q", q, 2)
    check_gqa(num_heads, num_kv_heads)
    block_tables = check_tensor("block_tables", block_tables, 2, INDEX_DTYPES_32)
    seq_lens = check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES_32)
    if block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise KernelInputError(
            f"block_tables must be [B={batch}, max_blocks] with a dense last dim, got shape "
            f"{tuple(block_tables.shape)} strides {tuple(block_tables.stride())}"
        )
    check_shape("seq_lens", seq_lens, (batch,))
    if not seq_lens.is_contiguous():
        raise KernelInputError("seq_lens must be contiguous")
    check_devices(("q", "kv_cache", "block_tables", "seq_lens"),
                  (q, kv_cache, block_tables, seq_lens))
    qk_scale = check_scale(scale) * LOG2E
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        out = check_out(out, (batch, num_heads, head_dim), q.dtype, q.device)
    bound = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    bound = check_positive_int("max_seq_len", bound)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, bound, device_num_sms(q.device))
    num_splits = check_positive_int("num_splits", num_splits)
    if batch == 0:
        return out
    kv_scales = (check_kv_scale("k_scale", k_scale, kv_cache.dtype, kv_cache.device),
                 check_kv_scale("v_scale", v_scale, kv_cache.dtype, kv_cache.device))
    if isinstance(kv_scales[0], torch.Tensor) != isinstance(kv_scales[1], torch.Tensor):
        raise KernelInputError("k_scale and v_scale must both be floats or both be tensors")
    _launch(q, kv_cache, block_tables, seq_lens, qk_scale, out, num_splits, kv_scales)
    return out


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qk_scale: float,
    out: torch.Tensor,
    num_splits: int,
    kv_scales: tuple[KvScale, KvScale],
) -> None:
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    direct = num_splits == 1
    if direct:  # pass 1 writes `out`; the partial buffers are never touched
        mid_acc = mid_m = mid_l = out
    else:
        mid_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        mid_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        mid_l = torch.empty_like(mid_m)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    tiles = choose_decode_tiles(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_acc, mid_m, mid_l,
        qk_scale, kv_scales[0], kv_scales[1], num_heads, num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_N=tiles.block_n,
        DIRECT=direct,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dots(q.dtype),
        KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
        SCALE_IS_PTR=isinstance(kv_scales[0], torch.Tensor),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_heads)](
            mid_acc, mid_m, mid_l, out, num_heads, num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2,
        )
