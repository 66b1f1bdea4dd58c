"""Triton per-token dynamic FP8 quantization of activations (the A of W8A8 matmuls).

For each row x of `[T, K]`: scale = max(|x|) / 448 (an all-zero row gets float32's smallest
normal instead, so it stays zero), q = saturate(x / scale) in float8 e4m3fn. One program per row in two passes
over K (max, then quantize; the second pass reads the row from L2), so a `[T, K]` input costs one
launch — the torch expression of the same thing is ~6 kernels, which a batch-1 decode step would
pay 128 times. Same arithmetic as `reference.per_token_quant_fp8_ref` (float32 divide, round to
nearest even in the conversion), so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    check_devices,
    check_inner_dense,
    check_tensor,
    interpret_mode,
)
from engine.kernels._tl import reduce_max, round_to_e4m3
from engine.kernels.reference import FP8_MIN_SCALE


@triton.jit
def _per_token_quant_kernel(
    x_ptr,  # [T, K], rows `stride_x` apart
    q_ptr,  # [T, K] fp8 contiguous
    scale_ptr,  # [T] float32
    stride_x,
    K,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    PRE_ROUND: tl.constexpr,  # interpreter only: its own fp8 cast rounds wrongly
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.full([BLOCK], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(reduce_max(amax, 0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        if PRE_ROUND:
            q = round_to_e4m3(q)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, K]` (fp32/fp16/bf16, dense last dim) -> (q `[T, K]` float8 e4m3fn contiguous,
    scale `[T, 1]` float32) with x ≈ q * scale row by row. Allocates both; no host syncs."""
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    check_inner_dense("x", x, 1)
    check_devices(("x",), (x,))
    t, k = x.shape
    q = torch.empty((t, k), dtype=FP8_KV_DTYPE, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scale
    block = 64 if interpret_mode() else min(4096, triton.next_power_of_2(k))
    _per_token_quant_kernel[(t,)](x, q, scale, x.stride(0), k, FP8_MAX=FP8_E4M3_MAX,
                                  MIN_SCALE=FP8_MIN_SCALE, BLOCK=block,
                                  PRE_ROUND=interpret_mode(),
                                  num_warps=1 if interpret_mode() else 8)
    return q, scale
