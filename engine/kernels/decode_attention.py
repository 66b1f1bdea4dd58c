"""Triton paged decode attention: a few query tokens per sequence (one when decoding; 1 + the
drafts when verifying speculative tokens), split-K (flash-decoding), one kernel launch.

One program per `(sequence, kv_head, split)`. It takes all `GROUP = H / Hkv` query heads that
share the KV head, for each of the sequence's `QUERY_LEN` tokens, as one `[BLOCK_G, D]` matrix
(row = token * GROUP + head, padded to 16 rows for `tl.dot`), so each K/V tile is read once per
group and step: a verify step's extra query rows fill rows that decoding pads. Token `t` sits
at position `seq_len - QUERY_LEN + t` and attends causally up to it. A split's slice is
`ceil(ceil(n / num_splits) / BLOCK_N) * BLOCK_N` positions of the `n = seq_len - QUERY_LEN + 1`
that every token sees, computed on the device from `seq_lens` (the last non-empty split also
takes the final `QUERY_LEN - 1` positions), so every sequence uses all splits, the host never
reads `seq_lens`, and each row sees at least one position of every split it computes.

With `num_splits == 1` the program normalises and writes the output directly. Otherwise it
writes partial results per split::

    mid_m   [B, H, S]     running max of scaled scores (log2 domain)
    mid_l   [B, H, S]     sum of exp2(score - max)
    mid_acc [B, H, S, D]  unnormalised sum of p * V (float32)

and the *last arriver reduces* (as split-K GEMMs do with a semaphore): each program increments
a per-`(sequence, kv_head)` int32 counter with acquire-release semantics after its partial
stores, and the program that sees `num_splits - 1` rescales all splits of its GROUP heads to a
common max, divides, writes `out`, and resets the counter to 0. So no second launch and no
memset: the counters are zero before and after every launch, which is what lets a CUDA graph
replay the kernel as one node. An empty split (or `seq_len == 0`) has max -inf and weight 0; a
sequence with `seq_len == 0` (CUDA-graph padding) gets a zero output.

The counters live in one cached zeroed buffer per device (`split_counters`), shared by all
launches: launches in stream order are fine (each leaves it zeroed), concurrent launches on
different streams are not supported (the engine runs one stream).

A quantized (fp8 or int8) cache holds K/V divided by per-layer scales: the K scale is folded into
`qk_scale` and each split's `acc` is multiplied by the V scale (softmax weights are unaffected by
either). With bf16/fp16 q the tile dots then run in fp16 (the fp8 -> fp16 conversion is one
instruction per two values, int8 -> fp16 a few integer ops; fp8 -> bf16 is several): q is
multiplied by the whole `qk_scale` and rounded to fp16 once per program, which is at least as
precise as the bf16 q itself (10-bit vs 7-bit mantissa); K, V and P are fp16, the accumulators
float32. See `engine/kernels/_attention_tile.py`.
Over an int8 cache the QK dot runs on int8 by default (`DecodeTiles.qk_int8`): q is quantized per
row once per program and K is never converted.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._attention_tile import (
    LOG2E,
    KvCvt,
    attend_kv_tile,
    fp16_scaled_q,
    int8_scaled_q,
    log2_softcap,
    tile_dots,
)
from engine.kernels._checks import (
    FLOAT_DTYPES,
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
    check_window,
    interpret_mode,
    is_quantized_kv,
    next_power_of_2,
)
from engine.kernels._pdl import pdl_release, pdl_wait, use_pdl
from engine.kernels._tl import ceil_div, load_scale, reduce_max, reduce_sum

# Measured on an H200 (Llama-3.1-8B shapes, CUDA graphs): splits of 64 positions still pay off
# for a lone 1k sequence; 32 splits cover a lone 8k one.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 32
DEFAULT_NUM_SMS = 132  # H100/H200 SXM
# Elements of the `[rows, splits, D]` float32 tile the last split combines per step: 32 registers
# a thread at 4 warps, small next to the split loop's own (the kernel's register count is the
# maximum of both).
COMBINE_TILE_ELEMENTS = 4096
# Split counters allocated at first use: 16 KiB covers B * Hkv up to 4096, which no split
# batch reaches (`choose_num_splits` stops splitting at 2 programs per SM).
MIN_SPLIT_COUNTERS = 4096


# Per-step values are not specialised on (see `_prefill_kernel`): an eager step's metadata
# slices start anywhere (with one split, `counters_ptr` is `seq_lens_ptr`), and block-table
# widths and split counts vary from step to step.
@triton.jit(do_not_specialize=["block_tables_ptr", "seq_lens_ptr", "counters_ptr", "num_splits",
                               "stride_bt_b"])
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] contiguous (written when DIRECT, or by the last split to arrive)
    mid_acc_ptr,  # [B, H, S, D] float32 (written unless DIRECT)
    mid_m_ptr,  # [B, H, S] float32
    mid_l_ptr,  # [B, H, S] float32
    counters_ptr,  # [>= B * Hkv] int32, zero on entry and on exit (read unless DIRECT)
    qk_scale,
    k_scale,  # quantized cache: float32 scalar or pointer to one (SCALE_IS_PTR)
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
    BLOCK_R: tl.constexpr,  # GROUP rounded up to a power of two (rows of the final combine)
    CHUNK_S: tl.constexpr,  # splits combined per step of the final combine
    M_CHUNK: tl.constexpr,  # splits per step when finding their common max
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,
    F16_DOTS: tl.constexpr,  # quantized cache, 16-bit q: fp16 tile dots on a prescaled q
    KV_CVT: tl.constexpr,  # an `KvCvt` (F16_DOTS only)
    SCALE_IS_PTR: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,  # grid (Hkv, B, S) instead of (B, Hkv, S); see `DecodeTiles`
    USE_PDL: tl.constexpr,
    QUERY_LEN: tl.constexpr = 1,  # query tokens per sequence (q, out: [B * QUERY_LEN, H, D])
    QK_INT8: tl.constexpr = False,  # int8 cache: QK dot on int8 (see `DecodeTiles.qk_int8`)
    WINDOW: tl.constexpr = 0,  # sliding window (0: none); see `paged_decode_attention`
    SOFTCAP: tl.constexpr = 0.0,  # log2-domain score cap (0: none)
):
    pdl_wait(USE_PDL)  # everything below reads what earlier kernels wrote
    pdl_release(USE_PDL)
    if HEAD_MAJOR:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Positions every token of the sequence sees; the splits cut these, and the last
    # non-empty split also takes the rest (each token's own causal tail).
    shared_len = seq_len - (QUERY_LEN - 1)
    # With a window the first token sees only the last WINDOW of them: the splits cut those.
    lo = tl.maximum(shared_len - WINDOW, 0) if WINDOW > 0 else 0
    split_len = ceil_div(ceil_div(shared_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, shared_len)
    if QUERY_LEN > 1:
        end = tl.where((start < shared_len) & (end == shared_len), seq_len, end)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    token = g // GROUP  # [BLOCK_G] query token of each row
    heads = kv_head * GROUP + g % GROUP
    g_mask = g < GROUP * QUERY_LEN
    q_row = seq.to(tl.int64) * QUERY_LEN + token  # row of q / out: [B * QUERY_LEN, H, D]
    q_off = q_row[:, None] * stride_q_b + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]
    q_pos = shared_len - 1 + token  # [BLOCK_G] each row's own position (read when causal)
    if KV_QUANT:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_IS_PTR)
    q_scale = None
    if QK_INT8:
        q, q_scale = int8_scaled_q(q, qk_scale)
    elif F16_DOTS:  # once per program: the tile step then skips the per-score multiply
        q = fp16_scaled_q(q, qk_scale)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
    v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        acc, l_i, m_i = attend_kv_tile(
            acc, l_i, m_i, q, q_pos, n0, end, block_table_ptr, k_head_ptr, v_head_ptr,
            qk_scale, stride_cache_block, stride_cache_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_N,
            True, QUERY_LEN > 1, DOT_PRECISION, UPCAST_DOT, F16_DOTS, KV_CVT, q_scale,
            QK_INT8, WINDOW, SOFTCAP,
        )
    if KV_QUANT:
        acc = acc * load_scale(v_scale, SCALE_IS_PTR)

    row = q_row * num_heads + heads  # [BLOCK_G] index into [B * QUERY_LEN, H]
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
        counter_ptr = counters_ptr + seq * (num_heads // GROUP) + kv_head
        # All threads' partial stores happen before the (one-thread) release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # every other split's partials are visible now
            for t in tl.static_range(QUERY_LEN):  # each token's GROUP rows are adjacent
                first_row = ((seq.to(tl.int64) * QUERY_LEN + t) * num_heads
                             + kv_head * GROUP)  # index into [B * QUERY_LEN, H]
                _combine_splits(mid_acc_ptr, mid_m_ptr, mid_l_ptr, out_ptr, first_row,
                                num_splits, GROUP, HEAD_DIM, BLOCK_R, CHUNK_S, M_CHUNK)
            # Nobody else touches this counter in this launch (all have arrived); the
            # next launch on the stream starts after this store.
            tl.store(counter_ptr, 0)


@triton.jit
def _combine_splits(
    mid_acc_ptr,  # [B, H, S, D] float32
    mid_m_ptr,  # [B, H, S]
    mid_l_ptr,  # [B, H, S]
    out_ptr,  # [B, H, D]
    first_row,  # index into [B, H] of the group's first head
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK_S: tl.constexpr,
    M_CHUNK: tl.constexpr,
):
    """Rescale the splits of GROUP heads to a common max, sum, divide, store to `out`.

    Same arithmetic as the former separate reduce launch, taking CHUNK_S splits per step so the
    `[BLOCK_R, CHUNK_S, D]` tile stays a few registers per thread. Loads are `.cg` (L2, not
    L1): the partials were written by other programs, possibly on other SMs.
    """
    r = tl.arange(0, BLOCK_R)
    r_mask = r < GROUP
    rows = first_row + r  # [BLOCK_R]
    dims = tl.arange(0, HEAD_DIM)
    m_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, M_CHUNK):
        splits = s0 + tl.arange(0, M_CHUNK)
        mask = r_mask[:, None] & (splits < num_splits)[None, :]
        m = tl.load(mid_m_ptr + rows[:, None] * num_splits + splits[None, :], mask=mask,
                    other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, reduce_max(m, 1))
    # Empty splits (m = -inf) weigh exp2(-inf) = 0; when all are empty (seq_len == 0) m_max is
    # -inf too, so subtract 0 instead to avoid -inf - -inf = NaN.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    total = tl.full([BLOCK_R], 0.0, tl.float32)
    o = tl.full([BLOCK_R, HEAD_DIM], 0.0, tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        splits = s0 + tl.arange(0, CHUNK_S)
        mask = r_mask[:, None] & (splits < num_splits)[None, :]  # [BLOCK_R, CHUNK_S]
        mid = rows[:, None] * num_splits + splits[None, :]
        m = tl.load(mid_m_ptr + mid, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(mid_l_ptr + mid, mask=mask, other=0.0, cache_modifier=".cg")
        w = tl.exp2(m - m_max[:, None])  # [BLOCK_R, CHUNK_S]
        total += reduce_sum(w * l_s, 1)
        acc = tl.load(mid_acc_ptr + mid[:, :, None] * HEAD_DIM + dims[None, None, :],
                      mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        o += reduce_sum(acc * w[:, :, None], 1)  # [BLOCK_R, D]
    o = o / tl.where(total > 0.0, total, 1.0)[:, None]  # total == 0 only when o == 0
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], o.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None])


# device -> the counter buffer in use. Buffers it replaced stay alive in `_retired_counters`:
# a CUDA graph captured earlier still points at them (and they are still all zeros).
_split_counters: dict[torch.device, torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []


def split_counters(device: torch.device, size: int) -> torch.Tensor:
    """The zeroed int32 counters (at least `size`) the split programs of one launch arrive on.

    Cached per device and shared by every launch: each launch leaves them zero again, so
    stream-ordered launches (and CUDA-graph replays) need no memset. Not safe for concurrent
    launches on different streams. Grows (never shrinks) to the largest `B * Hkv` seen by
    allocating a new buffer, which must not happen during CUDA-graph capture (the zero fill
    would not run before eager use): warm up at the largest batch before capturing, as the
    engine does.
    """
    counters = _split_counters.get(device)
    if counters is not None and counters.numel() >= size:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise KernelInputError(
            f"paged_decode_attention needs {size} split counters but has "
            f"{0 if counters is None else counters.numel()} while a CUDA graph is being "
            "captured; run it once at this batch size before capturing (warm-up)"
        )
    if counters is not None:
        _retired_counters.append(counters)
    counters = torch.zeros(max(MIN_SPLIT_COUNTERS, next_power_of_2(size)), dtype=torch.int32,
                           device=device)
    _split_counters[device] = counters
    return counters


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
    batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS,
    query_len: int = 1,
) -> int:
    """Splits per sequence: none once `B * Hkv` programs give two per SM, else about four
    programs per SM when decoding, about one when verifying drafts (`query_len > 1`: each
    program's tiles carry `query_len` times the rows, and its last split combines `query_len`
    sets of partials; graph-replayed sweeps on an H200 at 1 + 4 tokens put the best at 8-16
    splits for 1 sequence, 8 for 4, 2-8 for 16, 1-2 for 64: bench/results/h200/
    probe_verify_graph_22b5b03.json).

    Pure function of host-side ints (never of `seq_lens`), so a CUDA graph captured for a batch
    bucket and a `max_seq_len` bound replays with the same grid. Each split keeps at least
    `MIN_TOKENS_PER_SPLIT` positions of the longest possible sequence.
    """
    programs = max(1, batch_size * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    wanted = triton.cdiv((4 if query_len == 1 else 1) * num_sms, programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@functools.lru_cache(maxsize=1)
def int8_qk_requested() -> bool:
    """`SPLITSERVE_INT8_QK` (default 1), read once per process: 0 keeps an int8 cache's QK dot
    on the fp16 path (K converted, q not rounded to int8: 1.0e-3 instead of 6.9e-3 from the
    reference on the H200, at 2.93 instead of 3.58 TB/s). A probe that flips it calls
    `int8_qk_requested.cache_clear()`."""
    value = os.environ.get("SPLITSERVE_INT8_QK", "1").strip()
    if value not in ("0", "1"):
        raise KernelInputError(f"SPLITSERVE_INT8_QK must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """Compile-time KV tile length and launch parameters of the split kernel.

    `head_major` orders the grid (Hkv, B, S): programs launched together are then the KV heads
    of one sequence, whose rows of a cache block are adjacent in memory (`[BS, Hkv, D]`), rather
    than one KV head of many sequences (a 128- or 256-byte run per token, strided by `Hkv * D`).
    """

    block_n: int
    num_warps: int
    num_stages: int
    head_major: bool = False
    kv_cvt: KvCvt = KvCvt.OPERAND  # where a quantized cache's tiles become fp16
    # A cap on registers per thread (Triton's `maxnreg`; None: the compiler's choice). ncu saw
    # the one-warp fp8 program at 180 registers, 8 warps per SM (ncu_decode_fp8_1warp_c37dd9a).
    maxnreg: int | None = None
    # int8 cache: q quantized per row to int8 once per program and the QK dot run on int8
    # tensor cores straight on the K tile as read (no conversion of K; scores exact up to q's
    # rounding, 1/254 of its row's largest value, as SageAttention's INT8 QK). PV stays fp16.
    qk_int8: bool = False


def choose_decode_tiles(head_dim: int, kv_dtype: torch.dtype | None = None,
                        num_splits: int = 1) -> DecodeTiles:
    """The best of sweeps on an H200 (tools/probes/probe_decode.py; 384 sequences of 1536 tokens),
    4 warps throughout. A 16-bit cache takes KV tiles of 64 positions (32 for D=256), 3-stage
    pipelined, grid head-major (4.34 vs 4.28 TB/s row-major; probe_decode_25457d2.json). An
    fp8 cache converts V in registers (`KvCvt.V_REGS`): with one split (batches large enough
    to fill the GPU, the throughput case) one-warp programs of 32 positions, 3 stages: 3.40
    TB/s against 3.16 for 128 positions at 4 warps on the same machine
    (probe_decode_fp8w_ee757dd.json; four warps wait on each other at 9 block-wide barriers a
    tile, `ncu_decode_fp8_9ab9ac6.txt`); split launches keep 128 positions at 4 warps, 3.20
    TB/s at 384 x 1,536 (probe_decode_fp8cvt_7f50869.json; Triton's conversion: 2.52, and 2.58
    before at 4 stages, probe_decode_25457d2.json), since the one-warp combine of the splits'
    partials was never measured.
    Batch 1 at 1k context was fastest with the 16-bit choice (6.8 µs a call). 16 positions in
    the interpreter, whose cost is per element."""
    if interpret_mode():  # int8 keeps its QK dot, so CPU tests run the GPU's int8 path
        return DecodeTiles(16, 1, 1, qk_int8=kv_dtype == torch.int8 and int8_qk_requested())
    if head_dim > 128:
        return DecodeTiles(32, 4, 2)
    if kv_dtype == torch.int8 and int8_qk_requested():
        # QK on int8: 3.58 TB/s vs 2.93 converting K (probe_decode_qk8_31e9531.json).
        if num_splits == 1:
            return DecodeTiles(64, 2, 3, kv_cvt=KvCvt.V_REGS, qk_int8=True)
        return DecodeTiles(128, 4, 3, kv_cvt=KvCvt.V_REGS, qk_int8=True)
    if kv_dtype is not None and is_quantized_kv(kv_dtype):
        if num_splits == 1:
            return DecodeTiles(32, 1, 3, kv_cvt=KvCvt.V_REGS)
        return DecodeTiles(128, 4, 3, kv_cvt=KvCvt.V_REGS)
    return DecodeTiles(64, 4, 3, head_major=True)


def combine_tiles(group: int, head_dim: int, num_splits: int) -> tuple[int, int, int]:
    """`(BLOCK_R, CHUNK_S, M_CHUNK)` of the last split's combine: the group's rows rounded up
    to a power of two, and the splits taken per step for the `[BLOCK_R, CHUNK_S, D]` partials
    (within `COMBINE_TILE_ELEMENTS`) and for their max. No wider than the splits (masked lanes
    still cost work); `choose_num_splits` yields few distinct powers of two, so few variants."""
    block_r = next_power_of_2(group)
    m_chunk = min(next_power_of_2(num_splits), next_power_of_2(MAX_SPLITS))
    chunk_s = max(1, min(m_chunk, COMBINE_TILE_ELEMENTS // (block_r * head_dim)))
    return block_r, chunk_s, m_chunk


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
    tiles: DecodeTiles | None = None,
    query_len: int = 1,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of `query_len` new tokens per sequence over its paged KV (causal among them);
    returns `out [B * query_len, H, D]`.

    q: `[B * query_len, H, D]` (dense in its last two dims; a sequence's tokens adjacent), dtype
    = kv_cache dtype (fp32/fp16/bf16 when the cache is fp8 or int8).
    query_len: 1 for decoding; 1 + drafts for a speculative verify step, whose `seq_lens` count
    all of its tokens (token t sits at position `seq_len - query_len + t`).
    kv_cache: `[2, NB, BS, Hkv, D]` contiguous, already holding this step's K/V.
    k_scale/v_scale: fp8 or int8 cache only (None = 1.0): the stored values times these are K and V;
    Python floats or one-element float32 tensors on the cache's device.
    tiles: override the tuned tile/launch choice (`choose_decode_tiles`), for sweeps and tests.
    block_tables: `[B, max_blocks]` int32; seq_lens: `[B]` int32 (KV length incl. this token).
    out: optional contiguous `[B, H, D]` buffer in q's dtype (written entirely, returned).
    num_splits: force the split count; by default chosen from `max_seq_len` (a host int bound
    on `seq_lens`, default `max_blocks * BS`) and the batch size to fill the GPU.
    sliding_window: W > 0 lets the token at position p see only positions p - W < j <= p (the
    splits then cut the last W + query_len - 1 positions, not the whole context); 0: all.
    logit_softcap: c > 0 caps each scaled score s at c * tanh(s / c) before the softmax.
    Mutates only `out` (and the cached split counters, which every launch leaves at zero, so
    launches must not overlap on different streams). No host syncs: CUDA-graph capturable for
    fixed shapes and bounds (a `B * Hkv` above `MIN_SPLIT_COUNTERS` must first run once
    outside the capture, to grow the counters).
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    q = check_tensor("q", q, 3, FLOAT_DTYPES)
    check_matches_cache("q", q, kv_cache.dtype)
    query_len = check_positive_int("query_len", query_len)
    if q.shape[0] % query_len:
        raise KernelInputError(f"q has {q.shape[0]} tokens, not a multiple of query_len "
                               f"{query_len}")
    batch, num_heads = q.shape[0] // query_len, q.shape[1]
    check_shape("q", q, (batch * query_len, num_heads, head_dim))
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
        out = torch.empty((batch * query_len, num_heads, head_dim), dtype=q.dtype,
                          device=q.device)
    else:
        out = check_out(out, (batch * query_len, num_heads, head_dim), q.dtype, q.device)
    bound = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    bound = check_positive_int("max_seq_len", bound)
    window = check_window(sliding_window)
    if window:  # what a sequence's tokens see of it at most
        bound = min(bound, window + query_len - 1)
    softcap = log2_softcap(logit_softcap)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, bound, device_num_sms(q.device),
                                       query_len)
    num_splits = check_positive_int("num_splits", num_splits)
    if batch == 0:
        return out
    kv_scales = (check_kv_scale("k_scale", k_scale, kv_cache.dtype, kv_cache.device),
                 check_kv_scale("v_scale", v_scale, kv_cache.dtype, kv_cache.device))
    if isinstance(kv_scales[0], torch.Tensor) != isinstance(kv_scales[1], torch.Tensor):
        raise KernelInputError("k_scale and v_scale must both be floats or both be tensors")
    if tiles is None:
        tiles = choose_decode_tiles(head_dim, kv_cache.dtype, num_splits)
    _launch(q, kv_cache, block_tables, seq_lens, qk_scale, out, num_splits, kv_scales, tiles,
            query_len, window, softcap)
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
    tiles: DecodeTiles,
    query_len: int = 1,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    rows, num_heads, head_dim = q.shape
    batch = rows // query_len
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    direct = num_splits == 1
    if direct:  # the kernel writes `out`; the partial buffers and counters are never touched
        mid_acc = mid_m = mid_l = out
        counters = seq_lens
    else:
        mid_acc = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        mid_m = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=q.device)
        mid_l = torch.empty_like(mid_m)
        counters = split_counters(q.device, batch * num_kv_heads)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_r, chunk_s, m_chunk = combine_tiles(group, head_dim, num_splits)
    dots = tile_dots(q.dtype, kv_cache.dtype, tiles.kv_cvt, q.device)
    grid = ((num_kv_heads, batch, num_splits) if tiles.head_major
            else (batch, num_kv_heads, num_splits))
    pdl = use_pdl(q.device)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_acc, mid_m, mid_l, counters,
        qk_scale, kv_scales[0], kv_scales[1], num_heads, num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group * query_len)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_N=tiles.block_n,
        DIRECT=direct,
        BLOCK_R=block_r,
        CHUNK_S=chunk_s,
        M_CHUNK=m_chunk,
        DOT_PRECISION=dots.precision,
        UPCAST_DOT=dots.upcast,
        KV_QUANT=is_quantized_kv(kv_cache.dtype),
        F16_DOTS=dots.f16,
        KV_CVT=int(dots.kv_cvt),
        SCALE_IS_PTR=isinstance(kv_scales[0], torch.Tensor),
        HEAD_MAJOR=tiles.head_major,
        USE_PDL=pdl,
        QUERY_LEN=query_len,
        QK_INT8=tiles.qk_int8 and kv_cache.dtype == torch.int8 and dots.f16,
        WINDOW=window,
        SOFTCAP=softcap,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        maxnreg=tiles.maxnreg,
        launch_pdl=pdl,
    )
