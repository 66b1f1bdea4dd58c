"""Triton RMSNorm with optional fused residual add (vLLM `fused_add_rms_norm` semantics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_contiguous,
    check_devices,
    check_shape,
    check_tensor,
    next_power_of_2,
)
from engine.kernels._pdl import pdl_release, pdl_wait, use_pdl
from engine.kernels._tl import reduce_sum


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] or dummy when HAS_RESIDUAL is False
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    new_residual_ptr,  # [T, N] or dummy
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # everything below reads what earlier kernels wrote
    pdl_release(USE_PDL)
    # One program per row; the whole row fits in registers (hidden sizes up to ~16k).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(new_residual_ptr + row * N + offs, x.to(new_residual_ptr.dtype.element_ty),
                 mask=mask)
    variance = reduce_sum(x * x, 0) / N
    rstd = 1.0 / tl.sqrt(variance + eps)
    normed = x * rstd
    if ROUND_BEFORE_WEIGHT:  # to the activation dtype before the multiply: HF LlamaRMSNorm
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    round_before_weight: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of contiguous `x [..., N]` with `weight [N]`.

    Without `residual` returns `normed` (new tensor, x's dtype). With `residual` (same shape and
    dtype as x) returns `(normed, new_residual)` where `new_residual = x + residual` summed in
    float32 and stored in x's dtype; the norm is of that sum. Inputs are not mutated.
    `round_before_weight`: x / rms(x) is rounded to x's dtype before the weight multiply, as
    transformers' Llama norm does; False multiplies in float32 and rounds once, as its Gemma
    norms do.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 0:
        raise KernelInputError("x must be a tensor of shape [..., hidden] with hidden >= 1")
    hidden = x.shape[-1]
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    check_contiguous("x", x)
    x2d = x.view(-1, hidden)  # [rows, hidden]
    weight = check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_shape("weight", weight, (hidden,))
    check_contiguous("weight", weight)
    tensors: list[torch.Tensor] = [x, weight]
    names = ["x", "weight"]
    if residual is not None:
        residual = check_tensor("residual", residual, x.dim(), (x.dtype,))
        check_shape("residual", residual, tuple(x.shape))
        check_contiguous("residual", residual)
        tensors.append(residual)
        names.append("residual")
    check_devices(names, tensors)
    if not isinstance(eps, int | float) or not eps > 0:
        raise KernelInputError(f"eps must be a positive float, got {eps!r}")
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    rows = x2d.shape[0]
    if rows > 0:
        block = next_power_of_2(hidden)
        pdl = use_pdl(x.device)
        _rms_norm_kernel[(rows,)](
            x2d,
            residual if residual is not None else x2d,
            weight,
            out,
            new_residual,
            float(eps),
            N=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            ROUND_BEFORE_WEIGHT=bool(round_before_weight),
            USE_PDL=pdl,
            num_warps=min(16, max(1, block // 256)),
            launch_pdl=pdl,
        )
    if residual is not None:
        return out, new_residual
    return out
