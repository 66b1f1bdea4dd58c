"""KV blocks moved by the GPU's copy engines (`cudaMemcpy2DAsync`) instead of by kernels.

Why not kernels: once a runner's decode graphs are captured, one kernel on any stream other than
the one they replay on makes every later decode step of the process ~0.14 ms slower at batch 8
(H200, tools/probes/probe_stream_cost.py, docs/performance.md "One stream after the decode graphs"),
while copies on a side stream do not. KV handoff must not wait for the engine's queued steps
either, so it copies on a side stream, and therefore by copy engine.

A cache `[L, 2, num_blocks, block_size, Hkv, D]` holds one block as `2L` equal pieces ("planes"),
one per layer and K/V, `num_blocks` pieces apart. So one 2-D copy moves a block (or a run of
consecutive blocks) in every plane: height `2L` rows of `run * block_plane_bytes`, pitches of
`num_blocks * block_plane_bytes`. torch has no strided device copy without a kernel, so the
runtime's `cudaMemcpy2DAsync` is called through ctypes, from the libcudart torch itself loaded.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import ConfigError

logger = logging.getLogger(__name__)

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


def block_runs(dst_ids: Sequence[int], src_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of blocks consecutive on both sides: (dst_first, src_first, length), in
    order, covering every pair (dst_ids[i], src_ids[i]) once."""
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(dst_ids)} blocks to fill from {len(src_ids)}")
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_ids, src_ids, strict=True):
        if runs:
            d0, s0, n = runs[-1]
            if d == d0 + n and s == s0 + n:
                runs[-1] = (d0, s0, n + 1)
                continue
        runs.append((d, s, 1))
    return runs


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime this process already loaded (torch's), or None (a CPU build, or one
    whose runtime is linked statically)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines()
                    if "/libcudart.so" in line.split()[-1]})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        logger.debug("KV DMA copies through %s", path)
        return lib
    return None


@functools.cache
def dma_requested() -> bool:
    """`SPLITSERVE_KV_DMA` (default 1), read once per process: 0 keeps every KV handoff copy on
    kernels, the path a process without a CUDA runtime to call takes anyway (for A/Bs, and as
    a way back should a driver's copies misbehave)."""
    value = os.environ.get("SPLITSERVE_KV_DMA", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"SPLITSERVE_KV_DMA must be 0 or 1, got {value!r}")
    return value == "1"


def dma_available() -> bool:
    """Whether `copy_blocks_dma`, `read_blocks_dma` and `write_blocks_dma` can run here (and
    are wanted: `dma_requested`)."""
    return dma_requested() and _cudart() is not None


def _memcpy_2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
               stream: torch.cuda.Stream) -> None:
    """Queue one 2-D copy on `stream`. The caller makes the stream's GPU current (the runtime
    takes the calling thread's device; a worker thread's is GPU 0 whatever the cache's)."""
    lib = _cudart()
    if lib is None:
        raise RuntimeError("no CUDA runtime loaded: DMA copies are unavailable")
    err = lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _CUDA_MEMCPY_DEFAULT,
                                stream.cuda_stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(err).decode()} "
                           f"({err})")


def _planes(cache: torch.Tensor) -> tuple[int, int, int]:
    """(planes, blocks, bytes of one block in one plane) of a contiguous cache."""
    if not cache.is_contiguous():
        raise ValueError("a KV cache for DMA copies must be contiguous")
    planes, blocks = cache.shape[0] * cache.shape[1], cache.shape[2]
    return planes, blocks, cache[0, 0, 0].numel() * cache.element_size()


def copy_blocks_dma(dst_cache: torch.Tensor, dst_ids: Sequence[int], src_cache: torch.Tensor,
                    src_ids: Sequence[int], streams: Sequence[torch.cuda.Stream]) -> None:
    """dst_cache[:, :, dst_ids] = src_cache[:, :, src_ids], one 2-D copy per run of consecutive
    blocks and stream, queued on `streams` (the caller waits for them all): each stream copies a
    share of the planes, so several copy engines can work at once. Both caches on one GPU, of
    one layout and dtype (checked by the caller); the block ids are checked here: a DMA copy has
    no bounds."""
    planes, dst_blocks, piece = _planes(dst_cache)
    src_planes, src_blocks, src_piece = _planes(src_cache)
    if (src_planes, src_piece) != (planes, piece):
        raise ValueError("the caches' blocks differ")
    if not streams:
        raise ValueError("no stream to copy on")
    _check_ids(dst_ids, dst_blocks, "destination")
    _check_ids(src_ids, src_blocks, "source")
    dst_base, src_base = dst_cache.data_ptr(), src_cache.data_ptr()
    share = -(-planes // len(streams))
    runs = block_runs(dst_ids, src_ids)
    logger.debug("KV copy: %d blocks in %d runs", len(dst_ids), len(runs))
    with torch.cuda.device(dst_cache.device):
        for k, stream in enumerate(streams):
            first = k * share
            height = min(share, planes - first)
            if height <= 0:
                break
            for d, s, n in runs:
                _memcpy_2d(dst_base + (first * dst_blocks + d) * piece, dst_blocks * piece,
                           src_base + (first * src_blocks + s) * piece, src_blocks * piece,
                           n * piece, height, stream)


def read_blocks_dma(cache: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor,
                    stream: torch.cuda.Stream) -> None:
    """host[i] = cache[:, :, block_ids[i]] for a pinned, contiguous `host` [n, L, 2, ...] of the
    cache's dtype, queued on `stream` (the caller waits for it)."""
    if not (host.is_contiguous() and host.is_pinned()):
        raise ValueError("the host buffer for DMA reads must be pinned and contiguous")
    _per_block(cache, block_ids, host, stream, into_cache=False)


def write_blocks_dma(cache: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor,
                     stream: torch.cuda.Stream) -> None:
    """cache[:, :, block_ids[i]] = src[i] for a contiguous `src` [n, L, 2, ...] of the cache's
    dtype, in host memory (pinned: asynchronous; pageable: the runtime stages it) or on the
    cache's GPU, queued on `stream` (the caller waits for it)."""
    if not src.is_contiguous() or src.dtype != cache.dtype:
        raise ValueError(f"DMA writes take contiguous {cache.dtype} blocks, got "
                         f"{'' if src.is_contiguous() else 'strided '}{src.dtype}")
    if src.device.type != "cpu" and src.device != cache.device:
        raise ValueError(f"blocks on {src.device} cannot be copied into a cache on {cache.device}")
    _per_block(cache, block_ids, src, stream, into_cache=True)


def _per_block(cache: torch.Tensor, block_ids: Sequence[int], buf: torch.Tensor,
               stream: torch.cuda.Stream, into_cache: bool) -> None:
    """One 2-D copy per block between the cache and `buf` (the blocks one after another): a
    block's planes are `piece` bytes apart in `buf` and `num_blocks * piece` in the cache."""
    planes, blocks, piece = _planes(cache)
    if buf.numel() * buf.element_size() != len(block_ids) * planes * piece:
        raise ValueError(f"{buf.numel() * buf.element_size()} bytes of blocks for "
                         f"{len(block_ids)} blocks of {planes * piece}")
    _check_ids(block_ids, blocks, "destination" if into_cache else "source")
    base, other = cache.data_ptr(), buf.data_ptr()
    with torch.cuda.device(cache.device):
        for i, b in enumerate(block_ids):
            in_cache = (base + b * piece, blocks * piece)
            in_buf = (other + i * planes * piece, piece)
            dst, src = (in_cache, in_buf) if into_cache else (in_buf, in_cache)
            _memcpy_2d(dst[0], dst[1], src[0], src[1], piece, planes, stream)


def _check_ids(ids: Sequence[int], num_blocks: int, side: str) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise IndexError(f"{side} block ids out of range [0, {num_blocks}): {bad[:8]}")
