"""Programmatic dependent launch (PDL, Hopper and later) for the decode-path kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs become resident as soon as every program of the predecessor has signalled
`gdc_launch_dependents` (or exited), and each one blocks in `gdc_wait` until the predecessor has
completed and its writes are visible. What runs before `gdc_wait` must touch only data no
earlier kernel writes (weights, addresses). So the launch latency and the prologue of kernel n+1
hide under the tail of kernel n, which matters at batch 1, where a decode step is ~200 kernels of
a few microseconds each. CUDA graphs capture the programmatic edges.

Every kernel that takes `USE_PDL` calls `pdl_wait()` before its first read of a tensor an
earlier kernel writes and `pdl_release()` right after it, and is launched with
`launch_pdl=USE_PDL`. When the kernel before it was not launched to release early (cuBLAS), the
edge degrades to a plain stream dependency, so mixing is safe.

On by default (`SPLITSERVE_PDL=0` turns it off); it takes effect only on CUDA devices of compute
capability 9.0 or later, outside the interpreter, with a Triton that has grid dependency
control. On the H200 it took batch-1 ITL from 4.24 to 4.09 ms and batch 8 from 5.06 to 4.86 ms,
one machine, runs on/off/on (bench/results/h200/ab_pdl_{on,off}_latency_db6b27a*.json); with the
earlier GEMV tiles it was slower (4.72 vs 4.41 ms, ab_latency_g1_p{1,0}_5333eb4.json).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.config import ConfigError
from engine.kernels._checks import cuda_capability_at_least, interpret_mode

try:  # grid dependency control: Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    _HAS_GDC = False


@functools.lru_cache(maxsize=1)
def pdl_requested() -> bool:
    """`SPLITSERVE_PDL`, read once per process (kernel launches ask on every call; a probe
    that flips it calls `pdl_requested.cache_clear()`)."""
    value = os.environ.get("SPLITSERVE_PDL", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"SPLITSERVE_PDL must be 0 or 1, got {value!r}")
    return value == "1"


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (see the module docstring)."""
    if not _HAS_GDC or interpret_mode() or device.type != "cuda" or not pdl_requested():
        return False
    return cuda_capability_at_least(device, (9, 0))


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the stream's previous kernel has completed (no-op without PDL)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the stream's next kernel become resident (no-op without PDL)."""
    if USE_PDL:
        gdc_launch_dependents()
