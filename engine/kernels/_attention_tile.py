"""The inner step shared by the paged attention kernels: attend one query tile to one KV tile.

The KV tile is `BLOCK_N` consecutive *positions* of one sequence, gathered token by token
through the block table (so the tile size is independent of the cache block size):

    pos  = n0 + [0, BLOCK_N)
    slot = block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    K    = k_cache[slot, kv_head, :]            # [BLOCK_N, HEAD_DIM], each row contiguous

Online softmax in the log2 domain (FlashAttention-2): scores are multiplied by
`qk_scale = scale * log2(e)` and exponentiated with exp2; `m_i` is the running row max,
`l_i` the running row sum, `acc` the unnormalised output, all float32.

A quantized (fp8 e4m3 or int8) cache's tiles are converted to the dots' operand dtype after
the load (exact: every e4m3 value and every integer in [-127, 127] is an fp16, bf16 and fp32
value); the callers fold the K scale into `qk_scale` and multiply the output by the V scale, so
the tile step itself never sees a KV scale. The operand dtype (`tile_dots`):

- quantized cache, 16-bit q (the engine's case): fp16. e4m3x2 -> f16x2 is one packed `cvt` on
  sm_89+, while e4m3 -> bf16 has no direct instruction on Hopper (it goes through f16/f32) and
  halved the decode kernel's bandwidth on an H200; int8 -> fp16 takes two byte permutes, an XOR
  and a packed subtract per four values in registers (`s8x4_to_f16`). The caller multiplies q by
  the whole `qk_scale` once, before the KV loop, and rounds it to fp16 (`fp16_scaled_q`), so the
  QK dot yields log2-domain scores directly (`Q_PRESCALED`: no per-score multiply) and q
  shrinks by ~log2(e) / sqrt(D) * k_scale (no fp16 overflow for realistic activations; the dots
  accumulate in fp32). fp16 has a
  10-bit mantissa, bf16 7: the scaled q in fp16 is at least as precise as a bf16 q was (an fp16
  q takes one more rounding at its own precision). Only entries below fp16's normal range,
  |q * qk_scale| < 2**-14, lose relative precision, and each adds at most 2**-25 * |k| to a
  score's error. P is rounded to fp16 for the PV dot (likewise finer than bf16); acc, m_i and
  l_i stay float32.
  Where the conversion to fp16 happens is a launch choice (`KvCvt`). Left to Triton, it
  converts while loading each dot operand from shared memory; for V (the PV dot's B operand,
  whose mma fragments pair *consecutive positions*, i.e. bytes of two cache rows) that load is
  one `LDS.U8` per value plus byte packing, and an H200's fp8 decode read about 2.6 TB/s
  against 4.3 for bf16. Converting in registers right after the global load instead
  (`e4m3x4_to_f16` / `s8x4_to_f16`, opaque inline asm, so Triton cannot move it past the layout
  change) stages V to shared memory as fp16, which `ldmatrix.trans` then reads 16 bytes at a
  time: sm_90 SASS of the fp8 decode loop at 128-position tiles drops from 1,332 to 761
  instructions per iteration and from 194 to 149 registers (Triton 3.6, compiled offline), and
  the H200 read 3.20 TB/s (bench/results/h200/probe_decode_fp8cvt_7f50869.json).
- int8 cache, 16-bit q, `QK_INT8` (the decode kernel's default for int8): the scaled q is
  quantized per row to int8 instead (`int8_scaled_q`: its row's largest |value| at 127), the QK
  dot runs on int8 tensor cores straight on the K tile as loaded (no conversion of K) and
  accumulates exactly in int32, and one multiply by q's row scale gives the log2-domain score.
  The only added error is q's rounding, up to 1/254 of its row's largest value (SageAttention
  quantizes q the same way): decode outputs 6.9e-3 (relative) from the reference against
  1.0e-3 through fp16, for 3.58 instead of 2.93 TB/s on an H200
  (bench/results/h200/probe_decode_qk8_31e9531.json). P and V stay on the fp16 path.
- quantized cache, fp32 q: fp32 operands and IEEE dots, as for an fp32 cache (exact dequantisation;
  the slow path, kept as the precise one).
- any other cache: q's dtype, which is the cache's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FP8_KV_DTYPE,
    check_softcap,
    cuda_capability_at_least,
    interpret_mode,
    is_quantized_kv,
)
from engine.kernels._tl import reduce_max, reduce_sum

LOG2E = 1.4426950408889634


@triton.jit
def attend_kv_tile(
    acc,  # [M, HEAD_DIM] float32
    l_i,  # [M] float32
    m_i,  # [M] float32
    q,  # [M, HEAD_DIM] in the dots' dtype (see `tile_dots`); times qk_scale if Q_PRESCALED
    q_pos,  # [M] int32: KV position of each query row (only read when CAUSAL)
    n0,  # first KV position of this tile
    kv_limit,  # positions >= kv_limit are masked (only read when BOUNDS_MASK)
    block_table_ptr,  # this sequence's row of the block table
    k_head_ptr,  # k_cache + kv_head * HEAD_DIM
    v_head_ptr,  # v_cache + kv_head * HEAD_DIM
    qk_scale,  # only read unless Q_PRESCALED
    stride_cache_block,
    stride_cache_tok,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BOUNDS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (Triton 3.9)
    Q_PRESCALED: tl.constexpr,  # q already carries qk_scale (the fp16 path of a quantized cache)
    KV_CVT: tl.constexpr = 0,  # a `KvCvt`: where one-byte K/V become fp16 (Q_PRESCALED only)
    q_scale=None,  # [M] float32, QK_INT8 only: q = q_scale * q (int8), prescaled
    QK_INT8: tl.constexpr = False,  # int8 cache: the QK dot on int8 q and the int8 K tile as read
    WINDOW: tl.constexpr = 0,  # > 0: row r sees only positions > q_pos[r] - WINDOW (read q_pos)
    SOFTCAP: tl.constexpr = 0.0,  # > 0: log2-domain scores s become SOFTCAP * tanh(s / SOFTCAP)
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
    if QK_INT8:  # integer dot, exact; one multiply per score restores the log2-domain scale
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * q_scale[:, None]
    else:
        if KV_CVT == 2:  # KvCvt.KV_REGS
            k = byte_kv_to_f16(k)
        else:  # quantized cache -> fp16 or fp32; a no-op when the cache is q's dtype
            k = k.to(q.dtype)
        if UPCAST_DOT:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, BLOCK_N]
        if not Q_PRESCALED:
            s = s * qk_scale
    if SOFTCAP > 0.0:
        s = soft_cap(s, SOFTCAP)
    if CAUSAL:
        visible = pos[None, :] <= q_pos[:, None]
        if BOUNDS_MASK:
            visible = visible & in_bounds[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
    elif WINDOW > 0:
        visible = pos[None, :] > q_pos[:, None] - WINDOW
        if BOUNDS_MASK:
            visible = visible & in_bounds[None, :]
        s = tl.where(visible, s, float("-inf"))
    elif BOUNDS_MASK:
        s = tl.where(in_bounds[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, reduce_max(s, 1))
    # Without a window every caller guarantees each real row sees >= 1 position in its first
    # tile, so m_new is finite for real rows from then on and exp2(-inf - m_new) = 0 for masked
    # entries. With one a row may see nothing of a tile, even of a whole split, when its window
    # starts past them: its max stays -inf, and exponents are taken against 0 instead, so its
    # masked entries weigh 0 rather than NaN.
    m_exp = m_new
    if WINDOW > 0:
        m_exp = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_exp)
    p = tl.exp2(s - m_exp[:, None])
    l_i = l_i * alpha + reduce_sum(p, 1)
    if BOUNDS_MASK:
        v = tl.load(v_head_ptr + kv_off, mask=in_bounds[:, None], other=0.0)
    else:
        v = tl.load(v_head_ptr + kv_off)
    if KV_CVT != 0:  # KvCvt.V_REGS or KV_REGS
        v = byte_kv_to_f16(v)
    elif QK_INT8:  # q is int8 here; the PV dot stays on the fp16 path
        v = v.to(tl.float16)
    else:
        v = v.to(q.dtype)
    if UPCAST_DOT:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), tanh through exp2 (the interpreter has no tanh): 1 - 2 / (e^2x + 1)
    saturates to +-1 without overflow (exp2 of a large x is inf, 2 / inf is 0). The scores are
    in the log2 domain, so the host passes the cap times log2(e) (`log2_softcap`)."""
    e = tl.exp2(s * (2.8853900817779268 / cap))  # 2 log2(e) / cap: exp2(2 x log2 e) = e^2x
    return cap * (1.0 - 2.0 / (e + 1.0))


def log2_softcap(softcap: object) -> float:
    """A soft cap on natural-log scores (checked) as the kernels apply it to log2-domain scores
    (s2 = s * log2(e), so cap * tanh(s / cap) * log2(e) = cap2 * tanh(s2 / cap2)); 0 stays 0."""
    return check_softcap(softcap) * LOG2E


@triton.jit
def int8_scaled_q(q, qk_scale):
    """q times the whole score scale, quantized per row to int8 (symmetric, the row's largest
    |value| at 127, halves away from zero): (q int8 [M, D], scale [M] float32). The operand
    of the int8 QK dot (`QK_INT8`); a row of zeros keeps scale 1."""
    qf = q.to(tl.float32) * qk_scale
    amax = reduce_max(tl.abs(qf), 1)
    scale = tl.where(amax > 0.0, amax / 127.0, 1.0)
    y = qf / scale[:, None]
    y = y + tl.where(y >= 0.0, 0.5, -0.5)
    return y.to(tl.int8), scale


@triton.jit
def byte_kv_to_f16(x):
    """A one-byte K/V tile (fp8 e4m3 or int8, chosen at compile time) -> fp16 in registers."""
    if x.dtype == tl.int8:
        y = s8x4_to_f16(x)
    else:
        y = e4m3x4_to_f16(x)
    return y


@triton.jit
def e4m3x4_to_f16(x):
    """fp8 e4m3 -> fp16 in the tensor's current (load) layout, two packed `cvt`s per 4 values.

    Not marked pure on purpose: Triton hoists pure elementwise ops on a dot operand into the
    operand's shared-memory load, which is what this conversion exists to avoid (see the module
    docstring). Exact (every e4m3 value is an fp16 value). sm_89+ only (`kv_cvt_supported`).
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def s8x4_to_f16(x):
    """int8 -> fp16 in the tensor's current (load) layout, exactly, without `I2F`: each byte,
    biased by 128 (XOR 0x80), becomes the low byte of the fp16 0x64XX = 1024 + (x + 128) (two
    `prmt` per four values), and one packed subtract of 1152 per two values leaves x. Not pure,
    for the reason `e4m3x4_to_f16` gives; CUDA only (`kv_cvt_supported`)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 biased, lo, hi, bias;
        mov.b32 bias, 0x64806480;
        xor.b32 biased, $2, 0x80808080;
        prmt.b32 lo, biased, 0x64646464, 0x4140;
        prmt.b32 hi, biased, 0x64646464, 0x4342;
        sub.f16x2 $0, lo, bias;
        sub.f16x2 $1, hi, bias;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def fp16_scaled_q(q, qk_scale):
    """q times the whole score scale, rounded once to fp16: the loop-invariant operand of the
    fp16 tile path (`Q_PRESCALED`). The product is formed in float32, so only the final
    rounding (10-bit mantissa) is lost."""
    return (q.to(tl.float32) * qk_scale).to(tl.float16)


class KvCvt(enum.IntEnum):
    """Where `attend_kv_tile` turns one-byte (fp8 or int8) K and V tiles into fp16 (the KV_CVT
    argument)."""

    OPERAND = 0  # Triton's choice: while loading each dot operand from shared memory
    V_REGS = 1  # V in registers after its global load (`byte_kv_to_f16`); K as OPERAND
    KV_REGS = 2  # both in registers after their loads


@dataclass(frozen=True, slots=True)
class TileDots:
    """How `attend_kv_tile` runs its two dots; compile-time arguments of the attention kernels."""

    f16: bool  # quantized cache with 16-bit q: q prescaled and fp16, K/V/P fp16 (F16_DOTS)
    precision: str  # DOT_PRECISION
    upcast: bool  # UPCAST_DOT
    kv_cvt: KvCvt = KvCvt.OPERAND  # KV_CVT; only other than OPERAND when f16


def tile_dots(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    kv_cvt: KvCvt = KvCvt.OPERAND,
    device: torch.device | None = None,
) -> TileDots:
    """fp16 dots for a quantized (fp8 or int8) cache read with bf16/fp16 q (see the module
    docstring); otherwise dots in q's dtype, exactly as for a cache of q's dtype. `kv_cvt`
    applies to the fp16 path on a device that has the conversion (`kv_cvt_supported`), else
    falls back to OPERAND (also under the interpreter, which has no inline assembly)."""
    f16 = is_quantized_kv(kv_dtype) and q_dtype in (torch.bfloat16, torch.float16)
    operand = torch.float16 if f16 else q_dtype
    cvt = (kv_cvt if f16 and device is not None and kv_cvt_supported(device, kv_dtype)
           else KvCvt.OPERAND)
    return TileDots(f16, dot_precision(operand), upcast_dots(operand), cvt)


def kv_cvt_supported(device: torch.device, kv_dtype: torch.dtype = FP8_KV_DTYPE) -> bool:
    """Whether `byte_kv_to_f16` compiles for `device` and a cache of `kv_dtype`: not under the
    interpreter, on a CUDA GPU of compute capability 8.9+ for fp8 (`cvt.rn.f16x2.e4m3x2`) and
    any CUDA GPU for int8 (`prmt`, `sub.f16x2`: sm_53+)."""
    if interpret_mode() or device.type != "cuda":
        return False
    return kv_dtype != FP8_KV_DTYPE or cuda_capability_at_least(device, (8, 9))


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 dots for fp32 inputs (Triton would default to tf32); tf32 is ignored for 16-bit."""
    return "ieee" if dtype == torch.float32 or upcast_dots(dtype) else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether to run the dots in fp32: only for bf16 under the interpreter, whose bf16
    `tl.dot` returns garbage (seen with Triton 3.9; its fp16 dot is right); the GPU path keeps
    bf16 tensor-core dots."""
    return dtype == torch.bfloat16 and interpret_mode()
