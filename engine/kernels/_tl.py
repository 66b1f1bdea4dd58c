"""Reductions built on `tl.reduce` instead of `tl.max` / `tl.sum` / `tl.cdiv`.

Why: Triton's standard-library helpers (`tl.max`, `tl.sum`, `tl.cdiv`, `tl.zeros`) are themselves
`@jit` functions, decorated when Triton is first imported. If anything imports Triton before
`TRITON_INTERPRET=1` is set (e.g. `transformers` in a test session), those helpers stay compiled
functions and the interpreter refuses to call them. `tl.reduce` is patched by the interpreter and
our own combine functions are decorated when this module is imported, so these work in both
modes and compile to the same code on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    """Max of a float32 tensor along `axis` (like `tl.max`)."""
    return tl.reduce(x, axis, _maximum)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    """Sum of a float32 tensor along `axis` (like `tl.sum`)."""
    return tl.reduce(x, axis, _add)


@triton.jit
def ceil_div(a, b):
    """Integer ceil(a / b) for positive b (like `tl.cdiv`)."""
    return (a + b - 1) // b
