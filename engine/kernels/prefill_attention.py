"""Triton paged prefill attention: causal, varlen, over a prefix already held in cache blocks.

FlashAttention-2 tiling: one program per `(query tile, head, sequence)`. Query row `i` of
sequence `b` sits at KV position `ctx_b + i` with `ctx_b = seq_len_b - q_len_b` (the cached
prefix: earlier chunks of a chunked prefill, or a prefix-cache hit) and attends to positions
`<= ctx_b + i`. All of the sequence's K/V, this step's included, is read from the cache.

The KV loop has two phases: tiles entirely at or below the tile's first query position need no
mask; the remaining tiles up to the last row's position (the diagonal) are masked. Tiles past the
diagonal are never visited (causal early stop). Query tiles are launched last-first because the
late tiles of a sequence carry the most work.

A quantized (fp8 or int8) cache holds K/V divided by per-layer scales: the K scale is folded into
`qk_scale` and the normalised output is multiplied by the V scale. With bf16/fp16 q the tile dots
then run in fp16 (the fp8 -> fp16 conversion is one instruction per two values; fp8 -> bf16 is
several): q
is multiplied by the whole `qk_scale` and rounded to fp16 once per program, which is at least as
precise as the bf16 q itself (10-bit vs 7-bit mantissa); K, V and P are fp16, the accumulators
float32. See `engine/kernels/_attention_tile.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._attention_tile import (
    LOG2E,
    KvCvt,
    attend_kv_tile,
    fp16_scaled_q,
    log2_softcap,
    tile_dots,
)
from engine.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES_32,
    KernelInputError,
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
    check_window,
    interpret_mode,
    is_quantized_kv,
    next_power_of_2,
)
from engine.kernels._tl import ceil_div, load_scale


# Per-step values are not specialised on (`do_not_specialize`): Triton would otherwise compile
# a new variant whenever a block table's width reaches a multiple of 16, a query-tile count is 1,
# or a slice of the step's metadata (`seq_lens[nd:]`, `block_tables[nd:]`) starts off a 16-byte
# boundary; each compile stalls a serving step for ~1-2 s on an H200 (12 compiles in one
# offline run, bench/results/h200/probe_tput_bf16_529f918.json -> triton_compiles).
@triton.jit(do_not_specialize=["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr",
                               "num_m_tiles", "stride_bt_b"])
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    out_ptr,  # [T, H, D] contiguous
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    qk_scale,
    k_scale,  # quantized cache: float32 scalar or pointer to one (SCALE_IS_PTR)
    v_scale,
    num_m_tiles,
    stride_q_t,
    stride_q_h,
    stride_bt_b,
    stride_cache_block,
    stride_cache_tok,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,
    F16_DOTS: tl.constexpr,  # quantized cache, 16-bit q: fp16 tile dots on a prescaled q
    KV_CVT: tl.constexpr,  # an `KvCvt` (F16_DOTS only)
    SCALE_IS_PTR: tl.constexpr,
    WINDOW: tl.constexpr = 0,  # sliding window (0: none); see `paged_prefill_attention`
    SOFTCAP: tl.constexpr = 0.0,  # log2-domain score cap (0: none)
):
    m_tile = num_m_tiles - 1 - tl.program_id(0)  # heaviest (last) tiles first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 >= q_len:  # this sequence has fewer query tiles than the longest one
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < q_len
    tokens = (q_start + rows).to(tl.int64)
    q_off = tokens[:, None] * stride_q_t + head * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, D]
    q_pos = ctx_len + rows
    if KV_QUANT:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_IS_PTR)
    if F16_DOTS:  # once per program: the tile step then skips the per-score multiply
        q = fp16_scaled_q(q, qk_scale)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    kv_head = head // GROUP
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
    v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM

    # Phase 1: tiles whose last position <= the first row's position (ctx_len + m0): no mask.
    full_end = ((ctx_len + m0 + 1) // BLOCK_N) * BLOCK_N
    full_start = 0
    if WINDOW > 0:
        # Phase 0: from the tile holding the first row's first visible position up to the
        # first tile every row sees whole (positions >= the last row's position - WINDOW + 1),
        # masked by the window (and causally, where that range reaches the diagonal).
        first_tile = (tl.maximum(ctx_len + m0 - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        full_start = ceil_div(tl.maximum(ctx_len + m0 + BLOCK_M - WINDOW, 0), BLOCK_N) * BLOCK_N
        full_start = tl.maximum(full_start, first_tile)
        for n0 in range(first_tile, full_start, BLOCK_N):
            acc, l_i, m_i = attend_kv_tile(
                acc, l_i, m_i, q, q_pos, n0, seq_len, block_table_ptr, k_head_ptr, v_head_ptr,
                qk_scale, stride_cache_block, stride_cache_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
                True, True, DOT_PRECISION, UPCAST_DOT, F16_DOTS, KV_CVT, None, False, WINDOW,
                SOFTCAP,
            )
    for n0 in range(full_start, full_end, BLOCK_N):
        acc, l_i, m_i = attend_kv_tile(
            acc, l_i, m_i, q, q_pos, n0, seq_len, block_table_ptr, k_head_ptr, v_head_ptr,
            qk_scale, stride_cache_block, stride_cache_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
            False, False, DOT_PRECISION, UPCAST_DOT, F16_DOTS, KV_CVT, None, False, 0, SOFTCAP,
        )
    # Phase 2: the diagonal, up to the last row's position (bounded by seq_len).
    kv_end = tl.minimum(seq_len, ctx_len + m0 + BLOCK_M)
    for n0 in range(tl.maximum(full_end, full_start), kv_end, BLOCK_N):
        acc, l_i, m_i = attend_kv_tile(
            acc, l_i, m_i, q, q_pos, n0, seq_len, block_table_ptr, k_head_ptr, v_head_ptr,
            qk_scale, stride_cache_block, stride_cache_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
            True, True, DOT_PRECISION, UPCAST_DOT, F16_DOTS, KV_CVT, None, False, WINDOW,
            SOFTCAP,
        )

    if WINDOW > 0:  # padding rows past the sequence may see nothing of its window
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]  # every real row saw >= 1 position, so l_i > 0 there
    if KV_QUANT:
        o = o * load_scale(v_scale, SCALE_IS_PTR)
    out_off = tokens[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    """Compile-time tile shape and launch parameters of the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    kv_cvt: KvCvt = KvCvt.OPERAND  # where a quantized cache's tiles become fp16


def choose_prefill_tiles(head_dim: int, max_query_len: int) -> PrefillTiles:
    """Tile sizes for Hopper (FA-2 style); small query tiles when every query is short.

    D=128: 128x128 tiles, 8 warps, 3 stages were the best of a sweep on an H200 (Llama-3.1-8B
    shapes, ~310 TFLOP/s causal). D=256 (Gemma): 128x64, 8 warps, 3 stages, the best summed
    over a fresh 4,096-token prompt and chunks beside cached context, each plain and with a
    1,024-position window and capped scores (tools/probes/probe_prefill_tiles.py,
    bench/results/h200/probe_prefill_tiles_123543a.json: 0.395 vs 0.635 ms for the prompt at
    Gemma-2-9B's 16 / 8 heads against the 64x32, 4-warp, 2-stage tiles scaled from D=128).
    D=64 is scaled from D=128, not measured.
    """
    if interpret_mode():
        return PrefillTiles(16, 16, 1, 1)
    if head_dim <= 64:
        block_m, block_n, num_warps, num_stages = 128, 64, 4, 3
    elif head_dim <= 128:
        block_m, block_n, num_warps, num_stages = 128, 128, 8, 3
    else:
        block_m, block_n, num_warps, num_stages = 128, 64, 8, 3
    block_m = max(16, min(block_m, next_power_of_2(max_query_len)))
    if block_m < 64:
        num_warps = 4
    return PrefillTiles(block_m, block_n, num_warps, num_stages)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Causal varlen attention of `q [T, H, D]` over paged KV; returns `out [T, H, D]`.

    query_start_loc: `[B+1]` int32 (sequence b's queries are `q[qsl[b]:qsl[b+1]]`);
    seq_lens: `[B]` int32 (KV length incl. these queries, whose K/V are already in the cache);
    block_tables: `[B, max_blocks]` int32; max_query_len: a host int >= every q_len (tokens of a
    longer sequence past it are left unwritten). Rows with q_len = 1 (decodes) may be mixed in.
    q's dtype is the cache's, or fp32/fp16/bf16 for an fp8 or int8 cache, whose values times
    k_scale/v_scale (None = 1.0; Python floats or one-element float32 tensors) are K and V.
    tiles: override the tuned choice (`choose_prefill_tiles`), for sweeps and tests.
    sliding_window: W > 0 lets the query at position p see only positions p - W < j <= p (tiles
    wholly before a query tile's windows are skipped); 0: all. logit_softcap: c > 0 caps each
    scaled score s at c * tanh(s / c) before the softmax.
    Mutates only `out`. No host syncs.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    q = check_tensor("q", q, 3, FLOAT_DTYPES)
    check_matches_cache("q", q, kv_cache.dtype)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    check_shape("q", q, (num_tokens, num_heads, head_dim))
    check_inner_dense("q", q, 2)
    check_gqa(num_heads, num_kv_heads)
    seq_lens = check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES_32)
    batch = seq_lens.shape[0]
    query_start_loc = check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES_32)
    check_shape("query_start_loc", query_start_loc, (batch + 1,))
    block_tables = check_tensor("block_tables", block_tables, 2, INDEX_DTYPES_32)
    if block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise KernelInputError(
            f"block_tables must be [B={batch}, max_blocks] with a dense last dim, got shape "
            f"{tuple(block_tables.shape)} strides {tuple(block_tables.stride())}"
        )
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if not t.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous")
    check_devices(
        ("q", "kv_cache", "query_start_loc", "seq_lens", "block_tables"),
        (q, kv_cache, query_start_loc, seq_lens, block_tables),
    )
    qk_scale = check_scale(scale) * LOG2E
    max_query_len = check_positive_int("max_query_len", max_query_len)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        out = check_out(out, (num_tokens, num_heads, head_dim), q.dtype, q.device)
    ks = check_kv_scale("k_scale", k_scale, kv_cache.dtype, kv_cache.device)
    vs = check_kv_scale("v_scale", v_scale, kv_cache.dtype, kv_cache.device)
    if isinstance(ks, torch.Tensor) != isinstance(vs, torch.Tensor):
        raise KernelInputError("k_scale and v_scale must both be floats or both be tensors")
    window = check_window(sliding_window)
    softcap = log2_softcap(logit_softcap)
    if num_tokens == 0 or batch == 0:
        return out
    if tiles is None:
        tiles = choose_prefill_tiles(head_dim, max_query_len)
    dots = tile_dots(q.dtype, kv_cache.dtype, tiles.kv_cvt, q.device)
    num_m_tiles = triton.cdiv(max_query_len, tiles.block_m)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _prefill_kernel[(num_m_tiles, num_heads, batch)](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        qk_scale, ks, vs, num_m_tiles,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION=dots.precision,
        UPCAST_DOT=dots.upcast,
        KV_QUANT=is_quantized_kv(kv_cache.dtype),
        F16_DOTS=dots.f16,
        KV_CVT=int(dots.kv_cvt),
        SCALE_IS_PTR=isinstance(ks, torch.Tensor),
        WINDOW=window,
        SOFTCAP=softcap,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
