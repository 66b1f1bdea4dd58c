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
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add(a, b):
    return a + b


# The combine functions `tl.max` / `tl.min` / `tl.sum` pass to `tl.reduce` (the same code on the
# GPU as ours): the interpreter recognises them and reduces with one numpy call, where any other
# combine function runs once per element in Python (three quarters of an interpreted engine
# test's time: 48 of 63 s in test_gemv's). Ours where a Triton lacks them.
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)
_MIN = getattr(tl.standard, "_elementwise_min", _minimum)
_SUM = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    """Max of a float32 tensor along `axis` (like `tl.max`)."""
    return tl.reduce(x, axis, _MAX)


@triton.jit
def reduce_min(x, axis: tl.constexpr):
    """Min along `axis` (like `tl.min`)."""
    return tl.reduce(x, axis, _MIN)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    """Sum of a float32 (or integer) tensor along `axis` (like `tl.sum`)."""
    return tl.reduce(x, axis, _SUM)


@triton.jit
def cumsum(x, axis: tl.constexpr):
    """Inclusive prefix sum along `axis` (like `tl.cumsum`)."""
    return tl.associative_scan(x, axis, _SUM)


@triton.jit
def ceil_div(a, b):
    """Integer ceil(a / b) for positive b (like `tl.cdiv`)."""
    return (a + b - 1) // b


@triton.jit
def load_scale(scale, IS_PTR: tl.constexpr):
    """A KV scale as a float32 scalar: read through a pointer (a one-element tensor argument)
    or taken as given (a Python float argument)."""
    if IS_PTR:
        value = tl.load(scale).to(tl.float32)
    else:
        value = scale
    return value


@triton.jit
def round_to_e4m3(y):
    """Round float32 `y` (|y| <= 448) to the nearest float8 e4m3 value, ties to even, still in
    float32, so a later cast to fp8 is exact.

    Only for the interpreter: its fp32 -> fp8 cast drops the carry when rounding up the mantissa
    (1.98 becomes 1.0; Triton 3.9). The GPU casts with `cvt.rn.satfinite` and skips this.
    Adding then subtracting 1.5 * 2**23 * ulp rounds to a multiple of ulp in fp32 arithmetic;
    ulp is 2**(e - 3) for exponent e >= -6 and 2**-9 for e4m3 subnormals.
    """
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2**23 * ulp
    rounded = (a + magic) - magic
    return tl.where(y < 0, -rounded, rounded)
