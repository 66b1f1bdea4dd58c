"""Triton GEMV for one-row activations (batch-1 decode): `y = x @ W^T (+ b)`, optionally fused
with SiLU-and-mul for the gated MLP's gate/up projection.

At one row a linear layer is a pure weight stream, so the only thing that matters is how close
the kernel reads `W` to the memory roofline. On an H200 (Llama-3.1-8B shapes, 32 weight copies so
L2 never holds them, CUDA-graph replays; `bench/probe_bs1.py`, bench/results/h200/probe_bs1.json)
the four matmuls of a decode step took 3.56 ms through this kernel against 3.97 ms through cuBLAS
called with `out=`; but plain `F.linear` inside the engine's step picks better cuBLAS kernels
(3.74 ms per step vs 3.85 ms for this kernel, probe_bs1_2.json), so the model uses it only when
`SPLITSERVE_GEMV=1` (engine/model/layers.py).

Each program owns `BLOCK_N` output features and walks the whole K dimension in `BLOCK_K` chunks,
accumulating elementwise products in a `[BLOCK_N, BLOCK_K]` float32 tile and reducing it once at
the end (one cross-lane reduction per program rather than one per chunk). With `GATED`, the
program also walks the matching rows `I` further down (the "up" half of a fused gate/up weight)
and writes `silu(gate) * up`, so the MLP's activation kernel disappears.

This is the seam for weight-only quantized matmuls at batch 1 (dequantize the tile in registers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_devices,
    check_inner_dense,
    check_out,
    check_tensor,
    interpret_mode,
)
from engine.kernels._tl import reduce_sum


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] (one row)
    w_ptr,  # [N or 2N, K], rows `stride_w` apart
    b_ptr,  # [N or 2N] (read only when HAS_BIAS)
    out_ptr,  # [N]
    N,  # output features (the gate half's size when GATED)
    K,
    stride_w,
    up_offset,  # N * stride_w: where the "up" rows start (read only when GATED)
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no row mask
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no column mask
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1] pointers
    up_rows = gate_rows + up_offset
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    acc_up = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)[None, :]
            mask = row_mask[:, None]
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            mask = row_mask[:, None] & (kk < K)[None, :]
        if EVEN_N and EVEN_K:
            w = tl.load(gate_rows + kk[None, :])
        else:
            w = tl.load(gate_rows + kk[None, :], mask=mask, other=0.0)
        acc += w.to(tl.float32) * x
        if GATED:
            if EVEN_N and EVEN_K:
                wu = tl.load(up_rows + kk[None, :])
            else:
                wu = tl.load(up_rows + kk[None, :], mask=mask, other=0.0)
            acc_up += wu.to(tl.float32) * x
    y = reduce_sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        up = reduce_sum(acc_up, 1)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rows, mask=row_mask, other=0.0).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@dataclass(frozen=True, slots=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_gemv_tiles(n: int, k: int, gated: bool) -> GemvTiles:
    """Best of a sweep on an H200 (bench/results/h200/probe_bs1.json, Llama-3.1-8B shapes):
    8 rows per program; 512-wide chunks for the narrow (N <= 4096) outputs, 256 otherwise; 8
    warps for long rows (K >= 8192); 4 stages for the gated double stream, 3 otherwise."""
    if interpret_mode():
        return GemvTiles(8, 64, 1, 1)
    block_k = 512 if n <= 4096 else 256
    block_k = min(block_k, triton.next_power_of_2(k))
    return GemvTiles(8, block_k, 8 if k >= 8192 else 4, 4 if gated else 3)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    weight = check_tensor("weight", weight, 2, FLOAT_DTYPES)
    if x.shape[0] != 1:
        raise KernelInputError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    if weight.shape[1] != x.shape[1] or weight.shape[0] != rows:
        raise KernelInputError(
            f"weight must be [{rows}, K={x.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise KernelInputError(f"weight has dtype {weight.dtype} but x has {x.dtype}")
    check_inner_dense("x", x, 1)
    check_inner_dense("weight", weight, 1)
    if bias is not None:
        bias = check_tensor("bias", bias, 1, FLOAT_DTYPES)
        if bias.shape[0] != rows or not bias.is_contiguous():
            raise KernelInputError(f"bias must be a contiguous [{rows}], got {tuple(bias.shape)}")
        check_devices(("x", "weight", "bias"), (x, weight, bias))
    else:
        check_devices(("x", "weight"), (x, weight))
    return x, weight, bias


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            n: int, gated: bool) -> torch.Tensor:
    k = x.shape[1]
    if n == 0:
        return out
    tiles = choose_gemv_tiles(n, k, gated)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        n * weight.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gated,
        EVEN_N=n % tiles.block_n == 0,
        EVEN_K=k % tiles.block_k == 0,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [1, K] @ weight[N, K]^T (+ bias [N])` -> `[1, N]` in x's dtype (fp32 accumulation).

    x and weight must share a dtype and be dense in their last dim (weight's row stride may be
    padded). Mutates only `out` (a contiguous `[1, N]` buffer, allocated when None).
    """
    n = weight.shape[0] if weight.dim() == 2 else -1
    x, weight, bias = _check(x, weight, bias, n)
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    else:
        out = check_out(out, (1, n), x.dtype, x.device)
    return _launch(x, weight, bias, out, n, gated=False)


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """`silu(g) * u` where `[g | u] = x [1, K] @ weight[2I, K]^T (+ bias [2I])` -> `[1, I]`.

    The fused gate/up projection and the MLP activation in one pass over the weight; g and u stay
    in float32 (no rounding to x's dtype between the matmul and the activation).
    """
    rows = weight.shape[0] if weight.dim() == 2 else -1
    if rows % 2 != 0 or rows == 0:
        raise KernelInputError(f"weight must be [2*I, K] with I > 0, got {tuple(weight.shape)}")
    x, weight, bias = _check(x, weight, bias, rows)
    inter = rows // 2
    out = torch.empty((1, inter), dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, out, inter, gated=True)
