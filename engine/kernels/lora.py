"""LoRA's expand with each row's own adapter: `y[t] += h[t, cols of slot(t)] @ B[those rows]`.

engine/lora/stack.py lays every adapter's A and B side by side (`A_all [in, C]`, `B_all [C,
out]`, `col_slot [C]` naming each column's adapter) and computes `h = x @ A_all` for every row
and column. In torch the row's own columns are then kept by a [T, C] mask (made, multiplied
in) before `y.addmm_(h, B_all)`: three kernels per projection. This kernel keeps them while it
multiplies — one kernel, no mask tensor — and selects rather than multiplies, so a value in
another adapter's columns never reaches the row (not even an inf or NaN, which a zero mask
would turn into NaN). Shapes are static and nothing is read on the host: graph-capturable.
"""

from __future__ import annotations

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
)

# Rows per program: 16 for the few rows of small decode steps (the rest of the tile masked
# off), 64 above, so that B's tiles are read once per 64 rows rather than per 16.
_SMALL_M, _BLOCK_M = 16, 64
_BLOCK_N = 128
_BLOCK_K = 32


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [T, C], rows `stride_h` apart
    b_ptr,  # [C, N], rows `stride_b` apart
    cols_ptr,  # [C] int64: each column's adapter slot
    slots_ptr,  # [T] int64: each row's adapter slot (0: none)
    y_ptr,  # [T, N], rows `stride_y` apart; y += the rows' deltas
    num_rows,
    num_cols,
    n_out,
    stride_h,
    stride_b,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    out_ok = outs < n_out
    # A padding row's slot (-1) owns no column; a base-model row's (0) neither.
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    rows64 = rows.to(tl.int64)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)  # tl.zeros: see engine/kernels/_tl.py
    for k0 in range(0, num_cols, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < num_cols
        owner = tl.load(cols_ptr + ks, mask=k_ok, other=-2)
        h = tl.load(h_ptr + rows64[:, None] * stride_h + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        h = tl.where(slot[:, None] == owner[None, :], h, 0.0)
        b = tl.load(b_ptr + ks.to(tl.int64)[:, None] * stride_b + outs[None, :],
                    mask=k_ok[:, None] & out_ok[None, :], other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(h.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(h, b, acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows64[:, None] * stride_y + outs[None, :]
    ok = row_ok[:, None] & out_ok[None, :]
    y = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=ok)


def lora_expand(h: torch.Tensor, b_all: torch.Tensor, col_slot: torch.Tensor,
                token_slots: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Add to `y [T, N]` (in place; returned) each row's `h [T, C]` over its own adapter's
    columns times `b_all [C, N]`: `y[t] += Σ_{c: col_slot[c] == token_slots[t]} h[t, c]
    b_all[c]`. `h`, `b_all`, `y` of one float dtype, dense in their last dim; `col_slot [C]`
    and `token_slots [T]` int64. float32 accumulation."""
    h = check_tensor("h", h, 2, FLOAT_DTYPES)
    b_all = check_tensor("b_all", b_all, 2, (h.dtype,))
    y = check_tensor("y", y, 2, (h.dtype,))
    col_slot = check_tensor("col_slot", col_slot, 1, (torch.int64,))
    token_slots = check_tensor("token_slots", token_slots, 1, (torch.int64,))
    num_rows, num_cols = h.shape
    if b_all.shape[0] != num_cols or col_slot.shape[0] != num_cols:
        raise KernelInputError(f"h {tuple(h.shape)}, b_all {tuple(b_all.shape)} and col_slot "
                               f"{tuple(col_slot.shape)} must share C")
    if y.shape != (num_rows, b_all.shape[1]) or token_slots.shape[0] != num_rows:
        raise KernelInputError(f"y {tuple(y.shape)} must be [T, N] = [{num_rows}, "
                               f"{b_all.shape[1]}] and token_slots {tuple(token_slots.shape)} "
                               "[T]")
    for name, t in (("h", h), ("b_all", b_all), ("y", y)):
        check_inner_dense(name, t, 1)
    for name, t in (("col_slot", col_slot), ("token_slots", token_slots)):
        check_inner_dense(name, t, 1)
    check_devices(("h", "b_all", "col_slot", "token_slots", "y"),
                  (h, b_all, col_slot, token_slots, y))
    if num_rows and num_cols and y.shape[1]:
        block_m = _SMALL_M if num_rows <= _SMALL_M else _BLOCK_M
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(y.shape[1], _BLOCK_N))
        _lora_expand_kernel[grid](h, b_all, col_slot, token_slots, y, num_rows, num_cols,
                                  y.shape[1], h.stride(0), b_all.stride(0), y.stride(0),
                                  BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
                                  DOT_PRECISION=dot_precision(h.dtype),
                                  UPCAST_DOT=upcast_dots(h.dtype), num_warps=4)
    return y
