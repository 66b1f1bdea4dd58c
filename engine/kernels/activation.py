"""Triton SiLU-and-multiply for the gated MLP: `silu(x[:, :I]) * x[:, I:]`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_devices,
    check_inner_dense,
    check_tensor,
)
from engine.kernels._pdl import pdl_release, pdl_wait, use_pdl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I], rows `stride_x` apart
    out_ptr,  # [T, I] contiguous
    stride_x,
    inter,  # I
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # everything below reads what earlier kernels wrote
    pdl_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Return `silu(x[:, :I]) * x[:, I:]` as a new `[T, I]` tensor in x's dtype (fp32 math).

    `x [T, 2*I]` must be dense in its last dim; its row stride may be padded.
    """
    x = check_tensor("x", x, 2, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0 or x.shape[1] == 0:
        raise KernelInputError(f"x must be [T, 2*I] with an even last dim, got {tuple(x.shape)}")
    check_inner_dense("x", x, 1)
    check_devices(("x",), (x,))
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        grid = (num_tokens, triton.cdiv(inter, _BLOCK))
        pdl = use_pdl(x.device)
        _silu_and_mul_kernel[grid](x, out, x.stride(0), inter, BLOCK=_BLOCK, USE_PDL=pdl,
                                   num_warps=4, launch_pdl=pdl)
    return out
