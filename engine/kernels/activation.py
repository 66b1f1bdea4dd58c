"""Triton activation-and-multiply for the gated MLP: `act(x[:, :I]) * x[:, I:]` with SiLU
(Llama) or GELU's tanh approximation (Gemma, transformers' `gelu_pytorch_tanh`)."""

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
def gelu_tanh(x):
    """0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), as x * sigmoid(2z): the same
    function (1 + tanh(z) = 2 sigmoid(2z)) without a tanh, which the interpreter lacks, and
    without the cancellation of 1 - 2 / (exp(2z) + 1) near 0. exp overflowing to inf for very
    negative x gives x / inf = -0, the limit."""
    z2 = 1.5957691216057308 * (x + 0.044715 * x * x * x)  # 2 z; 1.5957... = 2 sqrt(2 / pi)
    return x / (1.0 + tl.exp(-z2))


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [T, 2 * I], rows `stride_x` apart
    out_ptr,  # [T, I] contiguous
    stride_x,
    inter,  # I
    GELU: tl.constexpr,  # GELU (tanh approximation) rather than SiLU
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
    if GELU:
        y = gelu_tanh(gate) * up
    else:
        y = silu(gate) * up
    tl.store(out_ptr + row * inter + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
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
        _act_and_mul_kernel[grid](x, out, x.stride(0), inter, GELU=gelu, BLOCK=_BLOCK,
                                  USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Return `silu(x[:, :I]) * x[:, I:]` as a new `[T, I]` tensor in x's dtype (fp32 math).

    `x [T, 2*I]` must be dense in its last dim; its row stride may be padded.
    """
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Return `gelu(x[:, :I], approximate="tanh") * x[:, I:]` as a new `[T, I]` tensor in x's
    dtype (fp32 math); `x` as for `silu_and_mul`."""
    return _act_and_mul(x, gelu=True)
