"""Triton GEMV for one-row activations (batch-1 decode): `y = x @ W^T (+ b)`, optionally fused
with SiLU-and-mul (or GELU-and-mul, Gemma) for the gated MLP's gate/up projection.

At one row a linear layer is a pure weight stream, so the only thing that matters is how close
the kernel reads `W` to the memory roofline, and how little else runs around it. The model
sends every one-row projection of the Triton path here (engine/model/layers.py,
`SPLITSERVE_GEMV`, on by default), with each RMSNorm and its residual add folded into the
projection after it (`rms_norm_gemv`) and SiLU-and-mul into the gate/up pass, so a layer is six
kernels (norm+QKV, RoPE+KV write, attention, O, norm+gate/up, down) instead of eleven with
cuBLAS (its split-K reduces included). On an H200 the 32 layers' matmuls and norms take 3.58 ms
this way (3.42 ms launched with PDL, engine/kernels/_pdl.py) against 3.99 ms through cuBLAS and
the norm and SiLU kernels, in one CUDA graph with every layer's own weights (`tools/probes/probe_pdl.py`,
bench/results/h200/probe_pdl_db6b27a.json).

Each program owns `BLOCK_N` output features and walks the whole K dimension in `BLOCK_K` chunks,
accumulating elementwise products in a `[BLOCK_N, BLOCK_K]` float32 tile and reducing it once at
the end (one cross-lane reduction per program rather than one per chunk). With `GATED`, the
program also walks the matching rows `I` further down (the "up" half of a fused gate/up weight)
and writes `silu(gate) * up` (`gelu_tanh(gate) * up` with `GELU`), so the MLP's activation
kernel disappears.

This is the seam for quantized matmuls at batch 1 (the tile is widened in registers): int8
weight-only (W8A16) with a scale per weight row, and fp8 W8A8, where `x` is the per-token
quantized row (float8 e4m3fn, one float32 `x_scale`) and the weight e4m3fn with a scale per row.
The product of two e4m3 values is exact in float32, so the W8A8 GEMV computes what cuBLASLt's
row-wise scaled fp8 matmul (`torch._scaled_mm`) computes, up to the order of the float32 sums.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    FP8_KV_DTYPE,
    KernelInputError,
    check_contiguous,
    check_devices,
    check_inner_dense,
    check_out,
    check_shape,
    check_tensor,
    check_weight_scale,
    interpret_mode,
)
from engine.kernels._pdl import pdl_release, pdl_wait, use_pdl
from engine.kernels._tl import reduce_sum
from engine.kernels.activation import gelu_tanh, silu

# The gated activations `rms_norm_gemv` takes (ModelConfig.hidden_act's names).
GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@triton.jit
def _gemv_chunk(acc, acc_up, sumsq, w, wu, k0, x_ptr, res_ptr, g_ptr, res_out_ptr, K,
                residual_limit, GATED: tl.constexpr, NORM: tl.constexpr,
                HAS_RES: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                INT8_CVT: tl.constexpr):
    """One K chunk: the activation chunk (with the norm prologue: `x + residual`, its squares
    summed, times the norm weight) times the weight tile(s) `w` / `wu`, loaded by the caller."""
    kk = k0 + tl.arange(0, BLOCK_K)
    kmask = kk < K
    if EVEN_K:
        x = tl.load(x_ptr + kk).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        if HAS_RES:
            if EVEN_K:
                x += tl.load(res_ptr + kk).to(tl.float32)
            else:
                x += tl.load(res_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            # One program writes the new residual stream; the others only read it.
            tl.store(res_out_ptr + kk, x.to(res_out_ptr.dtype.element_ty),
                     mask=kk < residual_limit)
        sumsq += x * x
        if EVEN_K:
            x *= tl.load(g_ptr + kk).to(tl.float32)
        else:
            x *= tl.load(g_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
    acc += _weights_f32(w, INT8_CVT) * x[None, :]
    if GATED:
        acc_up += _weights_f32(wu, INT8_CVT) * x[None, :]
    return acc, acc_up, sumsq


@triton.jit
def _weights_f32(w, INT8_CVT: tl.constexpr):
    if INT8_CVT == 2:  # Int8Cvt.MAGIC_X4
        return int8x4_to_f32(w)
    elif INT8_CVT == 1:  # Int8Cvt.MAGIC
        return int8_to_f32(w)
    else:
        return w.to(tl.float32)


@triton.jit
def int8_to_f32(w):
    """int8 -> float32 exactly, with integer ops and one add instead of `I2F`.

    `I2F` runs at a quarter of the FP32 rate on Hopper, one per weight (sm_90 SASS of the loop:
    32 per thread per 4 x 1024 tile, compiled offline). Here the byte biased by 128 (`v ^ 0x80`,
    0..255) becomes the low mantissa bits of 2**23: that float is 2**23 + v + 128, exact, and
    subtracting 2**23 + 128 leaves v. With the packed form (`int8x4_to_f32`) the H200's batch-1
    int8 GEMVs took 7-19% less time than with `I2F` (bench/results/h200/probe_int8_gemv_139c4e8.json).
    """
    biased = (w.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.int32)
    return (biased | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def int8x4_to_f32(w):
    """`int8_to_f32` on four packed bytes in inline PTX: one XOR per four weights, then one
    byte permute (the byte under the exponent bits 0x4B) and one subtraction per weight. The
    elementwise version spends ~1.5 integer ops per weight on the bias and the OR. CUDA only."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, c;
        xor.b32 t, $4, 0x80808080;
        mov.b32 c, 0x4B000000;
        prmt.b32 $0, t, c, 0x7650;
        prmt.b32 $1, t, c, 0x7651;
        prmt.b32 $2, t, c, 0x7652;
        prmt.b32 $3, t, c, 0x7653;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[w],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _load_tiles(gate_rows, up_rows, k0, row_mask, K, GATED: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    kk = k0 + tl.arange(0, BLOCK_K)
    if EVEN_N and EVEN_K:
        w = tl.load(gate_rows + kk[None, :])
    else:
        w = tl.load(gate_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :],
                    other=0.0)
    wu = w
    if GATED:
        if EVEN_N and EVEN_K:
            wu = tl.load(up_rows + kk[None, :])
        else:
            wu = tl.load(up_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :],
                         other=0.0)
    return w, wu


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] (one row)
    w_ptr,  # [N or 2N, K], rows `stride_w` apart
    b_ptr,  # [N or 2N] (read only when HAS_BIAS)
    out_ptr,  # [N]
    res_ptr,  # [K] residual in (read only when NORM and HAS_RES)
    g_ptr,  # [K] RMSNorm weight (read only when NORM)
    res_out_ptr,  # [K] new residual `x + residual` (written only when NORM and HAS_RES)
    ws_ptr,  # [N or 2N] float32 per-row weight scales (read only when W_SCALE: 8-bit weights)
    xs_ptr,  # [1] float32 scale of a quantized x (read only when X_SCALE: fp8 W8A8)
    N,  # output features (the gate half's size when GATED)
    K,
    stride_w,
    up_offset,  # N * stride_w: where the "up" rows start (read only when GATED)
    eps,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,  # GATED only: GELU (tanh approximation) rather than SiLU
    NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    W_SCALE: tl.constexpr,
    X_SCALE: tl.constexpr,
    INT8_CVT: tl.constexpr,  # an `Int8Cvt` (int8 weights only; 0 otherwise)
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no row mask
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no column mask
    USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    gate_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1] pointers
    up_rows = gate_rows + up_offset
    # The first weight tile does not depend on the previous kernel: with PDL its load is in
    # flight while that kernel finishes.
    w, wu = _load_tiles(gate_rows, up_rows, 0, row_mask, K, GATED, EVEN_N, EVEN_K, BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    residual_limit = tl.where(pid == 0, K, 0)  # K for the program that writes it, else 0
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    acc_up = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    sumsq = tl.full([BLOCK_K], 0.0, tl.float32)
    acc, acc_up, sumsq = _gemv_chunk(acc, acc_up, sumsq, w, wu, 0, x_ptr, res_ptr, g_ptr,
                                     res_out_ptr, K, residual_limit, GATED, NORM, HAS_RES,
                                     EVEN_K, BLOCK_K, INT8_CVT)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w, wu = _load_tiles(gate_rows, up_rows, k0, row_mask, K, GATED, EVEN_N, EVEN_K, BLOCK_K)
        acc, acc_up, sumsq = _gemv_chunk(acc, acc_up, sumsq, w, wu, k0, x_ptr, res_ptr, g_ptr,
                                         res_out_ptr, K, residual_limit, GATED, NORM, HAS_RES,
                                         EVEN_K, BLOCK_K, INT8_CVT)
    y = reduce_sum(acc, 1)
    if NORM:
        # RMSNorm's scale is one scalar per row of x, so it factors out of the dot product.
        rstd = 1.0 / tl.sqrt(reduce_sum(sumsq, 0) / K + eps)
        y *= rstd
    if W_SCALE:  # 8-bit weights: one scale per output row, also outside the dot product
        y *= tl.load(ws_ptr + rows, mask=row_mask, other=0.0)
    x_scale = 1.0
    if X_SCALE:  # a quantized x: its one scale, outside the dot product too
        x_scale = tl.load(xs_ptr)
        y *= x_scale
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        up = reduce_sum(acc_up, 1)
        if NORM:
            up *= rstd
        if W_SCALE:
            up *= tl.load(ws_ptr + N + rows, mask=row_mask, other=0.0)
        if X_SCALE:
            up *= x_scale
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rows, mask=row_mask, other=0.0).to(tl.float32)
        if GELU:
            y = gelu_tanh(y) * up
        else:
            y = silu(y) * up
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


class Int8Cvt(enum.IntEnum):
    """How an int8 weight tile becomes float32 (the INT8_CVT argument)."""

    I2F = 0  # Triton's `.to(float32)`: one quarter-rate `I2F` per weight on Hopper
    MAGIC = 1  # `int8_to_f32`: integer ops and an add, elementwise (also under the interpreter)
    MAGIC_X4 = 2  # `int8x4_to_f32`: the same on packed bytes in inline PTX (CUDA only)


@dataclass(frozen=True, slots=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    int8_cvt: Int8Cvt = Int8Cvt.MAGIC_X4  # int8 weights only


def choose_gemv_tiles(n: int, k: int, gated: bool) -> GemvTiles:
    """Best of a sweep on an H200 at the four batch-1 calls of Llama-3.1-8B, norm-fused QKV and
    gate/up, plain O and down (`tools/probes/probe_pdl.py --sweep`,
    bench/results/h200/probe_gemv_sweep_9ee8372.json): 4 rows per program, 1024-wide chunks, 4
    warps, 4 stages was best or within 0.3% of best at every one (the QKV call went from 20.2 to
    16.3 us against the earlier 8 x 256 choice, tuned before the norm was fused)."""
    if interpret_mode():
        return GemvTiles(8, 64, 1, 1, Int8Cvt.MAGIC)  # no inline asm in the interpreter
    return GemvTiles(4, min(1024, triton.next_power_of_2(k)), 4, 4)


@dataclass(frozen=True, slots=True)
class _Operands:
    """Checked GEMV inputs; `out_dtype` is the result's (x's own, unless x is quantized)."""
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_scale: torch.Tensor | None
    x_scale: torch.Tensor | None
    out_dtype: torch.dtype


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)}"
    return type(t).__name__


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
           weight_scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> _Operands:
    if x_scale is not None:  # fp8 W8A8: x quantized per token, weight e4m3fn with row scales
        x = check_tensor("x", x, 2, (FP8_KV_DTYPE,))
        if not (isinstance(x_scale, torch.Tensor) and x_scale.dtype == torch.float32
                and x_scale.numel() == 1):
            raise KernelInputError(f"x_scale must be a tensor holding one float32 (x's row "
                                   f"scale), got {_describe(x_scale)}")
        if weight_scale is None:
            raise KernelInputError("an fp8 x (x_scale given) needs fp8 weights with weight_scale")
        weight = check_tensor("weight", weight, 2, (FP8_KV_DTYPE,))
        if out_dtype not in FLOAT_DTYPES:
            raise KernelInputError(f"an fp8 x needs out_dtype, one of "
                                   f"{', '.join(str(d) for d in FLOAT_DTYPES)}; got {out_dtype}")
        check_devices(("x", "x_scale"), (x, x_scale))
    else:
        x = check_tensor("x", x, 2, FLOAT_DTYPES)
        if out_dtype is not None and out_dtype != x.dtype:
            raise KernelInputError(f"out_dtype {out_dtype} differs from x's {x.dtype}; only an "
                                   f"fp8 x (with x_scale) writes another dtype")
        out_dtype = x.dtype
        if weight_scale is not None:  # int8 weight-only: W = weight * weight_scale[:, None]
            weight = check_tensor("weight", weight, 2, (torch.int8,))
        else:
            weight = check_tensor("weight", weight, 2, FLOAT_DTYPES)
            if weight.dtype != x.dtype:
                raise KernelInputError(f"weight has dtype {weight.dtype} but x has {x.dtype}")
    if weight_scale is not None:
        weight_scale = check_weight_scale(weight_scale, weight.shape[0])
        check_devices(("weight", "weight_scale"), (weight, weight_scale))
    if x.shape[0] != 1:
        raise KernelInputError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    if weight.shape[1] != x.shape[1] or weight.shape[0] != rows:
        raise KernelInputError(
            f"weight must be [{rows}, K={x.shape[1]}], got {tuple(weight.shape)}")
    check_inner_dense("x", x, 1)
    check_inner_dense("weight", weight, 1)
    if bias is not None:
        bias = check_tensor("bias", bias, 1, FLOAT_DTYPES)
        if bias.shape[0] != rows or not bias.is_contiguous():
            raise KernelInputError(f"bias must be a contiguous [{rows}], got {tuple(bias.shape)}")
        check_devices(("x", "weight", "bias"), (x, weight, bias))
    else:
        check_devices(("x", "weight"), (x, weight))
    return _Operands(x, weight, bias, weight_scale, x_scale, out_dtype)


@dataclass(frozen=True, slots=True)
class _Norm:
    """The RMSNorm prologue: `norm(x + residual) * weight` feeds the matmul."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    residual_out: torch.Tensor | None


def _launch(ops: _Operands, out: torch.Tensor, n: int, gated: bool,
            norm: _Norm | None = None, gelu: bool = False) -> torch.Tensor:
    x, weight, bias, weight_scale = ops.x, ops.weight, ops.bias, ops.weight_scale
    k = x.shape[1]
    if n == 0:
        return out
    tiles = choose_gemv_tiles(n, k, gated)
    pdl = use_pdl(x.device)
    has_res = norm is not None and norm.residual is not None
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, bias if bias is not None else weight, out,
        norm.residual if has_res else x,  # type: ignore[union-attr]
        norm.weight if norm is not None else x,
        norm.residual_out if has_res else x,  # type: ignore[union-attr]
        weight_scale if weight_scale is not None else x,
        ops.x_scale if ops.x_scale is not None else x,
        n, k, weight.stride(0), n * weight.stride(0),
        norm.eps if norm is not None else 0.0,
        HAS_BIAS=bias is not None,
        GATED=gated,
        GELU=gelu,
        NORM=norm is not None,
        HAS_RES=has_res,
        W_SCALE=weight_scale is not None,
        X_SCALE=ops.x_scale is not None,
        INT8_CVT=int(tiles.int8_cvt) if weight.dtype == torch.int8 else 0,
        EVEN_N=n % tiles.block_n == 0,
        EVEN_K=k % tiles.block_k == 0,
        USE_PDL=pdl,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        launch_pdl=pdl,
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
         x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """`x [1, K] @ weight[N, K]^T (+ bias [N])` -> `[1, N]` (fp32 accumulation).

    x and weight must share a dtype and be dense in their last dim (weight's row stride may be
    padded), or `weight` is int8 with a float32 `weight_scale [N]` (W = weight * scale per row:
    int8 weight-only quantization; the tile is widened in registers and the scale applied to
    each finished dot product), or fp8 W8A8: x float8 e4m3fn with its float32 `x_scale` (one
    value, as `per_token_quant_fp8` returns it), weight e4m3fn with `weight_scale`, and the
    result in `out_dtype`. Without `x_scale` the result has x's dtype. Mutates only `out` (a
    contiguous `[1, N]` buffer, allocated when None).
    """
    n = weight.shape[0] if weight.dim() == 2 else -1
    ops = _check(x, weight, bias, n, weight_scale, x_scale, out_dtype)
    if out is None:
        out = torch.empty((1, n), dtype=ops.out_dtype, device=x.device)
    else:
        out = check_out(out, (1, n), ops.out_dtype, x.device)
    return _launch(ops, out, n, gated=False)


def _gated_rows(weight: torch.Tensor) -> int:
    rows = weight.shape[0] if weight.dim() == 2 else -1
    if rows % 2 != 0 or rows == 0:
        raise KernelInputError(f"weight must be [2*I, K] with I > 0, got {tuple(weight.shape)}")
    return rows


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      weight_scale: torch.Tensor | None = None,
                      x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
    """`silu(g) * u` where `[g | u] = x [1, K] @ weight[2I, K]^T (+ bias [2I])` -> `[1, I]`.

    The fused gate/up projection and the MLP activation in one pass over the weight; g and u stay
    in float32 (no rounding between the matmul and the activation).
    `weight_scale`, `x_scale`, `out_dtype`: 8-bit weights and an fp8 x, as in `gemv`.
    """
    rows = _gated_rows(weight)
    ops = _check(x, weight, bias, rows, weight_scale, x_scale, out_dtype)
    inter = rows // 2
    out = torch.empty((1, inter), dtype=ops.out_dtype, device=x.device)
    return _launch(ops, out, inter, gated=True)


def rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  gated: bool = False, weight_scale: torch.Tensor | None = None,
                  activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (with the residual add) fused into the next batch-1 projection.

    `h = x + residual` (float32, or `x` alone without `residual`), `a = h * rsqrt(mean(h^2) +
    eps) * norm_weight`, and returns `(a @ weight^T (+ bias), h)`; with `gated`, `weight` is a
    fused `[2I, K]` gate/up weight and the first result is `act(g) * u` (`[1, I]`), `act` the
    `activation` named (one of GATED_ACTIVATIONS: SiLU, or GELU's tanh approximation). `h` comes
    back in x's dtype (a new tensor; `x` itself without `residual`), as `rms_norm` returns it.

    Unlike `rms_norm` then `gemv`, `a` is never rounded to x's dtype: the norm's scale is applied
    to the float32 dot products, so results agree with the unfused pair to that rounding.
    Each program reads all of `x` (from L2: 8 KB at hidden size 4096) to sum its squares itself,
    so no program waits for another. `weight_scale`: int8 weights, as in `gemv` (an fp8 W8A8
    layer quantizes the normalised row first, so it cannot take the norm in here).
    """
    rows = _gated_rows(weight) if gated else (weight.shape[0] if weight.dim() == 2 else -1)
    ops = _check(x, weight, bias, rows, weight_scale)
    if activation not in GATED_ACTIVATIONS:
        raise KernelInputError(f"activation must be one of {', '.join(GATED_ACTIVATIONS)}, got "
                               f"{activation!r}")
    k = x.shape[1]
    norm_weight = check_tensor("norm_weight", norm_weight, 1, FLOAT_DTYPES)
    if norm_weight.shape[0] != k or not norm_weight.is_contiguous():
        raise KernelInputError(
            f"norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)}")
    check_devices(("x", "norm_weight"), (x, norm_weight))
    if not isinstance(eps, int | float) or not eps > 0:
        raise KernelInputError(f"eps must be a positive float, got {eps!r}")
    residual_out = None
    if residual is not None:
        residual = check_tensor("residual", residual, 2, (x.dtype,))
        check_shape("residual", residual, (1, k))
        check_contiguous("residual", residual)
        check_devices(("x", "residual"), (x, residual))
        residual_out = torch.empty_like(residual)
    n = rows // 2 if gated else rows
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _launch(ops, out, n, gated, _Norm(norm_weight, float(eps), residual, residual_out),
            gelu=activation == "gelu_pytorch_tanh")
    return out, (x if residual_out is None else residual_out)
