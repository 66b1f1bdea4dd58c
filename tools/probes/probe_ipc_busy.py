"""A same-GPU CUDA IPC pull beside busy processes (GPU): why a decode worker's pull took ~16 ms
longer by copy engine than by kernels while a prefill worker computed on the same H200
(docs/performance.md, "KV handoff by copy engine").

Two processes on one GPU, as in `probe_disagg.py`: an *owner* (the prefill worker) allocates a
Llama-3.1-8B-shaped bf16 cache and exports it through `kv_transfer.cuda_ipc`; the *importer*
(this process: the decode worker) maps it and copies blocks into a cache of its own. Each
method copies the blocks of a 2,000-token prompt (125 blocks of 2 MB) scattered, and in one
run, under four loads: nobody else busy, the owner busy (bf16 matmuls back to back on its GPU
context, as a prefill computes), this process busy (the same on its default stream, as the
decode worker's steps), both. Methods (`--methods`): copy engine on a side stream
(`copy_blocks_dma`, the product's path: a 2-D copy per run of blocks), the gather/scatter
kernels on a side stream (the path before), the same copies as one `cudaMemcpyBatchAsync` call
with and without the hint to overlap compute; each from the mapped cache and from a local one
(no IPC); and one tiny kernel (how long any work of this
process waits for the GPU). Per case, median of `--repeats` after one: the host's time to queue
the copies, the GPU time between two events on the copy's stream, the wall time until it is
done, and a bit-for-bit check.

Usage: PYTHONPATH=. python3 tools/probes/probe_ipc_busy.py --out F [--blocks 125] [--repeats 10]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.results import git_info
from engine.dma_copy import _cudart, block_runs, copy_blocks_dma, dma_available
from kv_transfer.cuda_ipc import CacheExport, CacheImporter, export_cache

SHAPE = (32, 2, 2048, 16, 8, 128)  # [L, 2, num_blocks, block_size, Hkv, D]: 2 MB bf16 blocks
LOADS = ("idle", "owner_busy", "self_busy", "both_busy")


class Matmuls:
    """bf16 matmuls back to back on the current device's default stream, from a thread, with
    at most a few queued (a prefill's or a decode loop's steady load)."""

    def __init__(self) -> None:
        self._a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        self._b = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
        self._run = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._run.set()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._run.clear()
        if self._thread is not None:
            self._thread.join()
        torch.cuda.synchronize()

    def _loop(self) -> None:
        stream = torch.cuda.default_stream()
        with torch.cuda.stream(stream):
            while self._run.is_set():
                for _ in range(4):  # ~0.4 ms each on an H200
                    torch.mm(self._a, self._b)
                stream.synchronize()


def owner() -> int:
    """The exporting process: prints its export as one JSON line, then obeys stdin lines
    `busy`, `idle`, `quit`, answering each with `ok`."""
    torch.manual_seed(0)
    cache = torch.randn(SHAPE, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    export = export_cache(cache)
    fields = {k: (v.hex() if isinstance(v, bytes) else v)
              for k, v in dataclasses.asdict(export).items()}
    print(json.dumps(fields), flush=True)
    load = Matmuls()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "busy":
            load.start()
        elif cmd == "idle":
            load.stop()
        elif cmd == "quit":
            load.stop()
            print("ok", flush=True)
            return 0
        print("ok", flush=True)
    return 0


def _parse_export(line: str) -> CacheExport:
    raw: dict[str, Any] = json.loads(line)
    for key in ("mem_handle", "ref_counter_handle", "event_handle"):
        raw[key] = bytes.fromhex(raw[key])
    return CacheExport(**raw)


def _measure(fn: Callable[[torch.cuda.Stream], None], stream: torch.cuda.Stream,
             repeats: int) -> dict[str, float]:
    """fn queues work on `stream`; → medians of queue time, GPU time, wall time (ms)."""
    issue, gpu, wall = [], [], []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record(stream)
        fn(stream)
        end.record(stream)
        t1 = time.perf_counter()
        end.synchronize()
        t2 = time.perf_counter()
        if i:  # the first is a warm-up
            issue.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
            gpu.append(start.elapsed_time(end))
        time.sleep(0.02)
    return {"issue_ms": round(statistics.median(issue), 3),
            "gpu_ms": round(statistics.median(gpu), 3),
            "wall_ms": round(statistics.median(wall), 3),
            "wall_ms_max": round(max(wall), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--blocks", type=int, default=125)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--methods", default="dma,kernels",
                   help="of dma, kernels, batch (cudaMemcpyBatchAsync, preferring to overlap "
                        "compute), batch_plain (the same without that flag)")
    p.add_argument("--runs", default="",
                   help="comma-separated run counts: also copy the blocks as that many runs "
                        "(both sides), e.g. 3,11 for the run-keeping pool's simulated p50 and "
                        "p90 (bench/results/cpu_block_runs/)")
    p.add_argument("--role", choices=("importer", "owner"), default="importer")
    args = p.parse_args()
    if args.role == "owner":
        return owner()
    if not args.out:
        p.error("--out is required")
    assert dma_available(), "no CUDA runtime to call"
    child = subprocess.Popen([sys.executable, __file__, "--role", "owner"], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None

    def tell(cmd: str) -> None:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"

    try:
        export = _parse_export(child.stdout.readline())
        src = CacheImporter().open(export, torch.device("cuda", 0), torch.bfloat16,
                                   (SHAPE[0], SHAPE[1], *SHAPE[3:]), source="owner")
        local = src.clone()
        dst = torch.zeros_like(src)
        load = Matmuls()
        n = args.blocks
        rng = random.Random(0)
        layouts = {"scattered": (rng.sample(range(SHAPE[2]), n), rng.sample(range(SHAPE[2]), n)),
                   "one_run": (list(range(n)), list(range(1024, 1024 + n)))}
        for k in (int(x) for x in args.runs.split(",") if x):
            layouts[f"runs_{k}"] = (_in_runs(n, k, SHAPE[2], rng), _in_runs(n, k, SHAPE[2], rng))
        side = torch.cuda.Stream()
        tiny = torch.zeros(1, device="cuda")

        def tiny_kernel(stream: torch.cuda.Stream) -> None:
            with torch.cuda.stream(stream):
                tiny.add_(1)

        rows: dict[str, Any] = {}
        for state in LOADS:
            if state in ("owner_busy", "both_busy"):
                tell("busy")
            if state in ("self_busy", "both_busy"):
                load.start()
            time.sleep(0.5)
            for layout, (src_ids, dst_ids) in layouts.items():
                cases = {f"{method}_{where}": (METHODS[method], source)
                         for method in args.methods.split(",")
                         for where, source in (("ipc", src), ("local", local))}
                for name, (copy, source) in cases.items():
                    dst.zero_()
                    torch.cuda.synchronize()
                    fn = functools.partial(copy, dst, dst_ids, source, src_ids)
                    rows[f"{state}/{layout}/{name}"] = _measure(fn, side, args.repeats)
                    exact = torch.equal(dst[:, :, dst_ids], local[:, :, src_ids])
                    rows[f"{state}/{layout}/{name}/exact"] = exact
            rows[f"{state}/tiny_kernel"] = _measure(tiny_kernel, side, args.repeats)
            if state in ("self_busy", "both_busy"):
                load.stop()
            if state in ("owner_busy", "both_busy"):
                tell("idle")
            print(state, json.dumps({k: v for k, v in rows.items() if k.startswith(state)}),
                  flush=True)
        tell("quit")
    finally:
        child.kill()
    doc = {"shape": SHAPE, "blocks": n, "repeats": args.repeats, "rows": rows,
           "gpu": torch.cuda.get_device_name(), "git": git_info(),
           "command": f"PYTHONPATH=. python3 tools/probes/probe_ipc_busy.py --blocks {n} "
                      f"--repeats {args.repeats} --methods {args.methods}"
                      + (f" --runs {args.runs}" if args.runs else "") + " --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


def _in_runs(n: int, k: int, num_blocks: int, rng: random.Random) -> list[int]:
    """`n` block ids as `k` runs of consecutive ids (sizes as equal as can be), one in each
    of `k` equal slices of the cache, at a random place in it."""
    sizes = [n // k + (i < n % k) for i in range(k)]
    slot = num_blocks // k
    if max(sizes) > slot:
        raise ValueError(f"{k} runs of up to {max(sizes)} blocks do not fit {num_blocks}")
    ids: list[int] = []
    for i, size in enumerate(sizes):
        start = i * slot + rng.randrange(slot - size + 1)
        ids.extend(range(start, start + size))
    return ids


def _dma(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int],
         stream: torch.cuda.Stream) -> None:
    """The product's same-GPU path, without its wait (which `_measure` does)."""
    copy_blocks_dma(dst, dst_ids, src, src_ids, [stream])


def _kernels(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int],
             stream: torch.cuda.Stream) -> None:
    """The gather/scatter kernels on `stream` (one slice: `copy_cache_blocks` without its wait,
    which `_measure` does)."""
    with torch.cuda.stream(stream):
        idx_d = torch.tensor(dst_ids, device="cuda")
        idx_s = torch.tensor(src_ids, device="cuda")
        dst.index_copy_(2, idx_d, src.index_select(2, idx_s))


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_SRC_ACCESS_ORDER_STREAM = 1
_MEM_LOCATION_DEVICE = 1
_PREFER_OVERLAP_WITH_COMPUTE = 1


@functools.cache
def _batch_api() -> tuple[Any, bool]:
    """cudaMemcpyBatchAsync and whether it takes CUDA 12.8's `failIdx` (gone in 13.0)."""
    lib = _cudart()
    assert lib is not None
    version = ctypes.c_int()
    assert lib.cudaRuntimeGetVersion(ctypes.byref(version)) == 0
    fn = lib.cudaMemcpyBatchAsync
    fail_idx = version.value < 13000
    args: list[Any] = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.POINTER(_MemcpyAttributes), ctypes.c_void_p, ctypes.c_size_t]
    fn.argtypes = [*args, ctypes.c_void_p, ctypes.c_void_p] if fail_idx else [
        *args, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    print("cudart", version.value, "failIdx" if fail_idx else "no failIdx", flush=True)
    return fn, fail_idx


def _batched(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int],
             stream: torch.cuda.Stream, flags: int = _PREFER_OVERLAP_WITH_COMPUTE) -> None:
    """One cudaMemcpyBatchAsync call: a 1-D copy per plane and run of consecutive blocks."""
    fn, fail_idx = _batch_api()
    planes, blocks = dst.shape[0] * dst.shape[1], dst.shape[2]
    src_blocks = src.shape[2]
    piece = dst[0, 0, 0].numel() * dst.element_size()
    runs = np.array(block_runs(dst_ids, src_ids), dtype=np.uint64).reshape(-1, 3)
    plane = np.arange(planes, dtype=np.uint64)[:, None]
    dsts = (dst.data_ptr() + (plane * blocks + runs[:, 0]) * piece).ravel()
    srcs = (src.data_ptr() + (plane * src_blocks + runs[:, 1]) * piece).ravel()
    sizes = np.broadcast_to(runs[:, 2] * piece, (planes, len(runs))).ravel().copy()
    attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM,
                              _MemLocation(_MEM_LOCATION_DEVICE, dst.device.index or 0),
                              _MemLocation(_MEM_LOCATION_DEVICE, dst.device.index or 0), flags)
    first = (ctypes.c_size_t * 1)(0)
    tail: list[Any] = [None] if fail_idx else []
    err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
             ctypes.byref(attrs), first, 1, *tail, stream.cuda_stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpyBatchAsync failed ({err})")


METHODS: dict[str, Callable[..., None]] = {
    "dma": _dma, "kernels": _kernels, "batch": _batched,
    "batch_plain": functools.partial(_batched, flags=0)}


if __name__ == "__main__":
    raise SystemExit(main())
