"""Triton matmul with int8 weights and activations in the model dtype (W8A16, weight-only int8):
`y = x @ (q * scale[:, None])^T (+ b)` for `x [M, K]`, `q [N, K]` int8, `scale [N]` float32.

Each program computes one `[BLOCK_M, BLOCK_N]` output tile, walking K in `BLOCK_K` chunks: the
int8 weight tile is widened to x's dtype in registers (exact: int8 values fit any float dtype's
mantissa) and fed to `tl.dot` with float32 accumulation; the per-row weight scale multiplies the
finished tile, since it is constant along K. Programs are ordered in groups of `GROUP_M` row
tiles, so the weight tiles a group reads stay in L2 while the group's row tiles use them.

One-row inputs (batch-1 decode) go through the GEMV instead (engine/kernels/gemv.py), which
takes the same int8 weight and scale. On an H200, with the tiles of `choose_w8a16_tiles`, it
beats cuBLAS on the bf16 weights it stands for at decode batch 8 but not at 64, and at 4096 rows
(prefill) it ran at ~450 TFLOP/s against cuBLAS's ~760 (bench/results/h200/
probe_int8_dequant_6521564.json). So `w8a16_linear` sends inputs of `DEQUANT_MIN_ROWS` rows and
more (prefill chunks) to cuBLAS on a weight widened for the call (`dequantize_int8`: one pass
that reads the int8 bytes and writes `q * scale` rounded to the model dtype), as vLLM's AWQ
layer does for large batches; the widened weight is a transient of the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._attention_tile import dot_precision, upcast_dots
from engine.kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_devices,
    check_inner_dense,
    check_tensor,
    check_weight_scale,
    interpret_mode,
)
from engine.kernels._tl import ceil_div


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart
    w_ptr,  # [N, K] int8, rows `stride_wn` apart
    s_ptr,  # [N] float32
    b_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = ceil_div(M, BLOCK_M)
    tiles_n = ceil_div(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # the tile is [BLOCK_K, BLOCK_N]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        if UPCAST_DOT:  # the interpreter's bf16 dot is wrong (engine/kernels/_attention_tile.py)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    acc *= tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr,  # [N, K] int8, rows `stride_wn` apart
    s_ptr,  # [N] float32
    out_ptr,  # [N, K] contiguous
    K,
    stride_wn,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = cols < K
    q = tl.load(w_ptr + row.to(tl.int64) * stride_wn + cols, mask=mask, other=0)
    scale = tl.load(s_ptr + row)
    tl.store(out_ptr + row.to(tl.int64) * K + cols,
             (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class MatmulTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Output features from which a weight is "wide" (Llama-3.1-8B's fused gate/up, 28,672): enough
# programs even with 128-feature tiles.
WIDE_N = 16384


def choose_w8a16_tiles(m: int, n: int = 0) -> MatmulTiles:
    """Tiles by the number of rows `m` and of output features `n` (interpreter: small ones).

    Up to 64 rows: the best of a sweep on an H200 at Llama-3.1-8B's four weights, 8 and 64 rows
    (tools/probes/probe_int8_gemv.py --parts w8a16, bench/results/h200/probe_w8a16_f6f7b5f.json).
    Narrow tiles (32 features) give the 4,096- and 6,144-feature weights enough programs; the
    wide gate/up keeps 128. At 8 rows the four calls of a layer take 87 µs against 119 for
    cuBLAS on bf16 weights (161 with the earlier 128-feature tiles); at 64 rows 163 against
    128 (258 before).
    Above 64 rows (CUDA-graph decode buckets; eager calls from `DEQUANT_MIN_ROWS` widen the
    weight instead): swept at 256 and 512 rows (bench/results/h200/
    probe_w8a16_large_5f4a686.json). The wide gate/up keeps 128 x 128 tiles at 8 warps; the
    narrow weights take 64 x 128 at 4 warps, the best single choice over both row counts: a
    layer's three narrow calls 294 -> 216 µs at 256 rows and 320 -> 287 at 512. Still 2-4x
    cuBLAS on bf16 weights at these sizes (kernel times only; no end-to-end run)."""
    if interpret_mode():
        return MatmulTiles(16, 16, 16, 1, 1)
    wide = n >= WIDE_N
    if m <= 16:
        return MatmulTiles(16, 128, 256, 4, 3) if wide else MatmulTiles(16, 32, 256, 4, 4)
    if m <= 64:
        return MatmulTiles(64, 128, 64, 4, 4) if wide else MatmulTiles(64, 32, 128, 4, 4)
    return MatmulTiles(128, 128, 64, 8, 3) if wide else MatmulTiles(64, 128, 64, 4, 4)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ (weight * weight_scale[:, None])^T (+ bias)` -> new `[M, N]` in x's dtype.

    x: float32/fp16/bf16, dense in its last dim. weight: int8 `[N, K]`, dense in its last dim.
    weight_scale: contiguous float32 `[N]`. bias: contiguous `[N]` in any float dtype.
    """
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    weight = check_tensor("weight", weight, 2, (torch.int8,))
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise KernelInputError(f"weight must be [N, K={k}], got {tuple(weight.shape)}")
    weight_scale = check_weight_scale(weight_scale, n)
    check_inner_dense("x", x, 1)
    check_inner_dense("weight", weight, 1)
    names, tensors = ["x", "weight", "weight_scale"], [x, weight, weight_scale]
    if bias is not None:
        bias = check_tensor("bias", bias, 1, FLOAT_DTYPES)
        if bias.shape[0] != n or not bias.is_contiguous():
            raise KernelInputError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
        names.append("bias")
        tensors.append(bias)
    check_devices(names, tensors)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    t = choose_w8a16_tiles(m, n)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _w8a16_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out,
        m, n, k, x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dots(x.dtype),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


# From this many rows `w8a16_linear` widens the weight and calls cuBLAS; fewer stay on the W8A16
# kernel, which reads the int8 bytes only once. On the H200 (probe_int8_dequant_c250902.json, a
# layer's four calls) the widened route took 356 us against 482 at 256 rows, 463 against 615 at
# 512, 2.80 ms against 4.05 at 4,096 (the kernel's tiles above 64 rows were never swept).
DEQUANT_MIN_ROWS = 256


def dequantize_int8(weight: torch.Tensor, weight_scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """`weight * weight_scale[:, None]` as a new dense `[N, K]` tensor of `dtype`: each product
    formed in float32 and rounded once to `dtype`."""
    weight = check_tensor("weight", weight, 2, (torch.int8,))
    n, k = weight.shape
    weight_scale = check_weight_scale(weight_scale, n)
    check_inner_dense("weight", weight, 1)
    check_devices(["weight", "weight_scale"], [weight, weight_scale])
    if dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n == 0 or k == 0:
        return out
    block_k = 16 if interpret_mode() else 1024
    _dequant_kernel[(n, triton.cdiv(k, block_k))](
        weight, weight_scale, out, k, weight.stride(0), BLOCK_K=block_k, num_warps=4)
    return out


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `w8a16_matmul` computes, by the faster route for `x`'s row count: the W8A16 kernel
    below `DEQUANT_MIN_ROWS` rows (and while a CUDA graph is being captured: the widened weight
    would live in the graph's pool), else cuBLAS on `dequantize_int8`'s widened weight.

    The routes round differently (the kernel multiplies exact int8 values and applies the scale
    to the float32 sum; the widened weight is rounded to x's dtype first), so a row's output can
    differ in its last bits with the number of rows it is computed with."""
    if (x.shape[0] < DEQUANT_MIN_ROWS
            or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        return w8a16_matmul(x, weight, weight_scale, bias)
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise KernelInputError(f"weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}")
    widened = dequantize_int8(weight, weight_scale, x.dtype)
    return torch.nn.functional.linear(x, widened, None if bias is None else bias.to(x.dtype))
