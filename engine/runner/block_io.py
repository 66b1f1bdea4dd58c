"""KV blocks in and out of a model runner's cache, for the KV handoff between workers and the
cache tiers: reads to the host, writes from the host, and copies from another cache of the same
layout (another process's, mapped through CUDA IPC).

These run on threads other than the engine's, beside its steps: on a GPU on a side stream of
their own where nothing a step writes can race them (`fence_kv_loads`), else on the engine's
step stream, after the steps queued there. With tensor parallelism every rank holds its KV
heads of each block: rank 0 gathers or scatters them (engine/runner/tp_driver.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from engine.attention.kv_quant import dequantize_kv, quantize_kv
from engine.dma_copy import copy_blocks_dma, dma_available, read_blocks_dma, write_blocks_dma
from engine.kernels._checks import is_quantized_kv
from engine.parallel.protocol import Op
from engine.runner.kv_memory import KVMemory
from engine.runner.tp_driver import TensorParallelDriver
from engine.sampler import to_device

# A same-GPU KV copy gathers this many blocks at a time (128 MB of an 8B model's bf16 KV).
_COPY_SLICE_BLOCKS = 64


class BlockIO:
    """Reads and writes the blocks of one runner's KV cache (`kv`); `step_stream` is the
    stream the runner's steps run on (None on a CPU)."""

    def __init__(self, kv: KVMemory, device: torch.device, step_stream: torch.cuda.Stream | None,
                 tp: TensorParallelDriver | None, shard_size: int) -> None:
        self.kv = kv
        self.device = device
        self.step_stream = step_stream
        self.tp = tp
        self.shard_size = shard_size
        if device.type == "cuda":
            dma_available()  # finds the CUDA runtime now, not during the first KV handoff
        self._copy_stream: torch.cuda.Stream | None = None  # KV handoff copies' side stream
        # Recorded on the step stream by `fence_kv_loads` when blocks for KV loads were handed
        # out; the side stream's writes into them wait for it (see there).
        self._load_fence: torch.cuda.Event | None = None

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """→ CPU tensor [n, num_layers, 2, block_size, Hkv, D] in the cache dtype (a copy; fp8 and
        int8 blocks are the stored values: multiply by `kv_scales` [L, 2], and for int8 by the
        channel factors [L, 2, Hkv, D] where there are any, to get K/V)."""
        with self._on_step_stream():
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            if self.tp is not None:
                host = self._gather_sharded_blocks(idx).to("cpu").contiguous()
            else:
                host = self._gather_blocks(idx).to("cpu").contiguous()
        return host.view(self.kv.kv_dtype) if self.kv.is_quantized else host

    def _gather_sharded_blocks(self, idx: torch.Tensor) -> torch.Tensor:
        """`_gather_blocks` over every rank: each holds its KV heads of the blocks; they are
        gathered here and laid side by side, in rank order, as the model's KV heads are."""
        assert self.tp is not None
        import torch.distributed as dist
        with self.tp.command(Op.READ_BLOCKS, [int(idx.shape[0])]):
            dist.broadcast(idx, src=0)
            local = self._gather_blocks(idx).contiguous()
            parts = [torch.empty_like(local) for _ in range(self.shard_size)]
            dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=4)

    def _gather_blocks(self, idx: torch.Tensor) -> torch.Tensor:
        """The cache's blocks `idx` as [n, num_layers, 2, block_size, Hkv, D] on the device
        (the raw bytes of a 1-byte cache: index_select has no fp8 kernel on the CPU)."""
        src = self.kv.cache.view(torch.uint8) if self.kv.is_quantized else self.kv.cache
        return src.index_select(2, idx).permute(2, 0, 1, 3, 4, 5)

    def read_leased_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """`read_blocks` for blocks that no kernel writes while they are read (a prefill
        worker's leased prompt: computed before the lease existed, kept until its release).

        On a GPU the copy runs on a side stream and the host waits for the copy alone. Through
        the engine's stream (`read_blocks`) it waited for every step queued before it: on a
        busy prefill worker, up to a step per call, for every block a decode worker pulls. The
        copy engines move the blocks straight into pinned memory (engine/dma_copy.py says
        why no kernel); without them (no CUDA runtime to call) a gather kernel does, on the
        same side stream."""
        stream = self._side_stream()
        if stream is None or self.tp is not None:
            return self.read_blocks(block_ids)
        if dma_available():
            host = torch.empty((len(block_ids), *self.kv.shape_per_block), dtype=self.kv.kv_dtype,
                               pin_memory=True)
            read_blocks_dma(self.kv.cache, block_ids, host, stream)
            stream.synchronize()
            return host
        with torch.cuda.stream(stream):
            blocks = self._gather_blocks(to_device(block_ids, torch.long, self.device))
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            host.copy_(blocks, non_blocking=True)
        stream.synchronize()
        return host.view(self.kv.kv_dtype) if self.kv.is_quantized else host

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        """Blocks `src_block_ids` of another cache of this layout (another process's, mapped
        through CUDA IPC, on this GPU or a peer) → this cache's `block_ids`; returns when done.

        From this GPU: by the copy engines on the side stream, waiting only for the steps that
        may still write these blocks stale (`fence_kv_loads`). Otherwise
        (a peer GPU's cache, or no CUDA runtime to call) by kernels on the step stream, after
        the steps already queued there: a kernel on a side stream, once the decode graphs are
        captured, measured +0.14 ms on every later batch-8 decode step of this process
        (tools/probes/probe_stream_cost.py --variant kv_copy; engine/dma_copy.py)."""
        if self.tp is not None:
            raise ValueError("a tensor-parallel engine's cache is split over its ranks; its KV "
                             "travels by shared memory or gRPC, not by one cache's IPC handle")
        side = self._side_stream()
        if side is not None and src_cache.device == self.kv.cache.device and dma_available():
            self._wait_for_load_fence(side)
            copy_cache_blocks(self.kv.cache, block_ids, src_cache, src_block_ids,
                              dma_streams=[side])
        else:
            copy_cache_blocks(self.kv.cache, block_ids, src_cache, src_block_ids,
                              self.step_stream)

    def fence_kv_loads(self) -> None:
        """Called by the engine's thread after a schedule handed out blocks for KV loads and
        before it launches the step: records where the step stream is.

        A block freed by the host can still be written by a step already launched (a request
        that finished or was preempted while its next token was in flight writes that token's
        K/V). The loads write their blocks from the side stream, unordered with the steps, so
        each write first waits for this event: for the steps launched before its blocks were
        handed out, which alone can hold a stale write to them, and not for the ones after."""
        if self.device.type != "cuda":
            return
        fence = torch.cuda.Event()
        fence.record(self.step_stream or torch.cuda.current_stream(self.device))
        self._load_fence = fence

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The stream KV handoff copies run on beside the engine's steps (None on a CPU)."""
        if self.device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    def _wait_for_load_fence(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait (on the device) for the last `fence_kv_loads`, before it writes a
        KV load's blocks."""
        fence = self._load_fence
        if fence is not None:
            stream.wait_event(fence)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor,
                     scales: torch.Tensor | None = None) -> None:
        """blocks: [n, num_layers, 2, block_size, Hkv, D] → kv_cache at block_ids.

        Quantized (fp8 or int8) cache: blocks of its dtype are stored values under `scales`
        ([L, 2]; None = this runner's `kv_scales`) and are re-quantized when those differ from
        ours (blocks under other channel factors never get here: those are in the model
        fingerprint); float blocks are real K/V values, quantized with our scales and channel
        factors (saturating at ±448 or ±127 times the scale). Called from threads other than the engine's; returns when the
        blocks are in the cache."""
        expected = (len(block_ids), *self.kv.shape_per_block)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"KV blocks have shape {tuple(blocks.shape)}, expected {expected}")
        if self.kv.is_quantized:
            src, cache = self._quantize_blocks(blocks, scales), self.kv.cache.view(torch.uint8)
        elif scales is not None:
            raise ValueError(f"scales are only for fp8 and int8 KV caches, this one is "
                             f"{self.kv.kv_dtype}")
        else:
            src, cache = blocks, self.kv.cache
        if self.tp is not None:
            self._scatter_sharded_blocks(block_ids, src, cache)
            return
        stream = self._side_stream()
        if (stream is not None and src.device.type == "cpu" and src.dtype == cache.dtype
                and dma_available()):
            # From the host by copy engine on the side stream: the blocks belong to a load no
            # step reads before it completes, so this waits only for the steps that may still
            # write them stale (`fence_kv_loads`), not for every queued one (a kernel would: on
            # the step stream, engine/dma_copy.py says why).
            self._wait_for_load_fence(stream)
            write_blocks_dma(cache, block_ids, src.contiguous(), stream)
            stream.synchronize()  # `blocks` may be a staging buffer reused after
            return
        if self.step_stream is not None:  # after what the caller queued on its own stream
            self.step_stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_step_stream():
            idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            dev = src.to(self.device, cache.dtype, non_blocking=True)
            cache.index_copy_(2, idx, dev.permute(1, 2, 0, 3, 4, 5))
        if self.step_stream is not None:
            self.step_stream.synchronize()  # `blocks` may be a staging buffer reused after

    def _scatter_sharded_blocks(self, block_ids: list[int], src: torch.Tensor,
                                cache: torch.Tensor) -> None:
        """`write_blocks` over every rank: blocks of every KV head (`src`, in `cache`'s dtype or
        its bytes) are cut by head into the ranks' shares and each rank writes its own."""
        assert self.tp is not None
        import torch.distributed as dist
        comm = self.device
        idx = torch.tensor(block_ids, dtype=torch.long, device=comm)
        parts = [p.to(comm, cache.dtype).contiguous()
                 for p in src.chunk(self.shard_size, dim=4)]
        with self._on_step_stream(), self.tp.command(Op.WRITE_BLOCKS, [len(block_ids)]):
            dist.broadcast(idx, src=0)
            mine = torch.empty_like(parts[0])
            dist.scatter(mine, parts, src=0)
            cache.index_copy_(2, idx, mine.permute(1, 2, 0, 3, 4, 5))
        if self.step_stream is not None:
            self.step_stream.synchronize()

    def _on_step_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Makes `step_stream` current in a thread other than the engine's (a no-op on a CPU)."""
        if self.step_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.step_stream)

    def _quantize_blocks(self, blocks: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """blocks [n, L, 2, bs, Hkv, D] → the uint8 bytes of this cache's values (fp8 or int8)
        under `kv_scales`."""
        ours = self.kv.scales.view(1, -1, 2, 1, 1, 1)  # broadcast over [n, L, 2, bs, Hkv, D]
        if blocks.dtype == self.kv.kv_dtype:
            if scales is None or torch.equal(scales.float().cpu(), self.kv.scales):
                return blocks.contiguous().view(torch.uint8)
            if tuple(scales.shape) != tuple(self.kv.scales.shape):
                raise ValueError(f"KV scales have shape {tuple(scales.shape)}, expected "
                                 f"{tuple(self.kv.scales.shape)}")
            values = dequantize_kv(blocks.cpu(), scales.float().cpu().view(1, -1, 2, 1, 1, 1))
            return quantize_kv(values, ours, self.kv.kv_dtype).view(torch.uint8)
        if scales is not None:
            raise ValueError(f"scales come with {self.kv.kv_dtype} blocks, not with {blocks.dtype} "
                             "ones")
        if is_quantized_kv(blocks.dtype):
            raise ValueError(f"{blocks.dtype} blocks cannot enter a {self.kv.kv_dtype} cache")
        values = blocks.cpu()
        factors = self.kv.channel_factors
        if factors is not None:  # [L, 2, Hkv, D] over [n, L, 2, bs, Hkv, D]
            values = values.float() / factors.unsqueeze(2).unsqueeze(0)
        return quantize_kv(values, ours, self.kv.kv_dtype).view(torch.uint8)

def copy_cache_blocks(dst_cache: torch.Tensor, dst_block_ids: list[int], src_cache: torch.Tensor,
                      src_block_ids: list[int], stream: torch.cuda.Stream | None = None,
                      dma_streams: Sequence[torch.cuda.Stream] = ()) -> None:
    """dst_cache[:, :, dst_block_ids] = src_cache[:, :, src_block_ids] for two caches
    [L, 2, num_blocks, block_size, Hkv, D] of one dtype (1-byte caches moved as raw bytes),
    `_COPY_SLICE_BLOCKS` blocks at a time; on `stream` if given, and then waits for it. The
    source may be on another GPU (a peer of the destination's): each slice is gathered there
    and copied across (torch orders the copy after the gather and before the scatter).
    `dma_streams`: by the copy engines instead, on those streams (`stream` unused), one 2-D
    copy per run of consecutive blocks and stream (both caches on one GPU; engine/dma_copy.py;
    more than one stream measured slower, tools/probes/probe_kv_dma.py). Raises ValueError when the
    caches' blocks differ, IndexError for a block id out of range."""
    if len(dst_block_ids) != len(src_block_ids):
        raise ValueError(f"{len(dst_block_ids)} blocks to fill from {len(src_block_ids)}")
    expected = (*dst_cache.shape[:2], *dst_cache.shape[3:])
    got = (*src_cache.shape[:2], *src_cache.shape[3:])
    same_place = src_cache.device == dst_cache.device or (
        src_cache.device.type == dst_cache.device.type == "cuda")
    if got != expected or src_cache.dtype != dst_cache.dtype or not same_place:
        raise ValueError(f"source cache {tuple(src_cache.shape)} {src_cache.dtype} on "
                         f"{src_cache.device} does not match the destination's blocks "
                         f"{tuple(dst_cache.shape)} {dst_cache.dtype} on {dst_cache.device}")
    if dma_streams:
        if src_cache.device != dst_cache.device or dst_cache.device.type != "cuda":
            raise ValueError("a DMA block copy needs both caches on one GPU")
        copy_blocks_dma(dst_cache, dst_block_ids, src_cache, src_block_ids, dma_streams)
        for s in dma_streams:
            s.synchronize()
        return
    one_byte = dst_cache.element_size() == 1  # fp8 / int8: index kernels work on the raw bytes
    dst = dst_cache.view(torch.uint8) if one_byte else dst_cache
    src = src_cache.view(torch.uint8) if one_byte else src_cache
    device = dst_cache.device
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for i in range(0, len(dst_block_ids), _COPY_SLICE_BLOCKS):
            dst_idx = to_device(dst_block_ids[i:i + _COPY_SLICE_BLOCKS], torch.long, device)
            src_idx = to_device(src_block_ids[i:i + _COPY_SLICE_BLOCKS], torch.long, src.device)
            dst.index_copy_(2, dst_idx, src.index_select(2, src_idx).to(device))
    if stream is not None:
        stream.synchronize()
