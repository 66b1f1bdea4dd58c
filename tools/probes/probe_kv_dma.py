"""KV block copies on one GPU: copy engines (engine/dma_copy.py) over 1..N streams against
the gather/scatter kernels, on Llama-3.1-8B-shaped bf16 caches (2 MB blocks). Device to device
(a same-GPU handoff: `copy_blocks_from`) with the blocks in one run or scattered, and device to
pinned host (a leased read: `read_leased_blocks`). Each case: median wall time of 5 calls after
one, the host waiting for the copy, and a bit-for-bit check. Run on the H200.

Usage: PYTHONPATH=. python3 tools/probes/probe_kv_dma.py --out F [--blocks 256] [--streams 1,2,4,8]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.results import git_info
from engine.dma_copy import dma_available, read_blocks_dma
from engine.runner.block_io import copy_cache_blocks

SHAPE = (32, 2, 1024, 16, 8, 128)  # [L, 2, num_blocks, block_size, Hkv, D]: 2 MB blocks in bf16


def _median_ms(fn: Callable[[], None], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--streams", default="1,2,4,8")
    args = p.parse_args()
    assert dma_available(), "no CUDA runtime to call"
    src = torch.randn(SHAPE, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros_like(src)
    n = args.blocks
    nbytes = n * src[:, :, 0].numel() * src.element_size()
    rng = random.Random(0)
    layouts = {"one_run": (list(range(n)), list(range(512, 512 + n))),
               "scattered": (rng.sample(range(SHAPE[2]), n), rng.sample(range(SHAPE[2]), n))}
    side = torch.cuda.Stream()
    rows: dict[str, dict[str, float]] = {}
    for name, (src_ids, dst_ids) in layouts.items():
        row: dict[str, float] = {}
        row["kernels_side_stream_ms"] = _median_ms(
            functools.partial(copy_cache_blocks, dst, dst_ids, src, src_ids, side))
        for k in [int(x) for x in args.streams.split(",")]:
            streams = [side] + [torch.cuda.Stream() for _ in range(k - 1)]
            dst.zero_()
            row[f"dma_{k}_streams_ms"] = _median_ms(
                functools.partial(copy_cache_blocks, dst, dst_ids, src, src_ids,
                                  dma_streams=streams))
            assert torch.equal(dst[:, :, dst_ids], src[:, :, src_ids]), (name, k)
        host = torch.empty((n, *SHAPE[:2], *SHAPE[3:]), dtype=src.dtype, pin_memory=True)

        def read_dma(s: list[int] = src_ids, h: torch.Tensor = host) -> None:
            read_blocks_dma(src, s, h, side)
            side.synchronize()

        def read_kernel(s: list[int] = src_ids, h: torch.Tensor = host) -> None:
            with torch.cuda.stream(side):
                idx = torch.tensor(s, device="cuda")
                h.copy_(src.index_select(2, idx).permute(2, 0, 1, 3, 4, 5), non_blocking=True)
            side.synchronize()

        row["read_dma_ms"] = _median_ms(read_dma)
        assert torch.equal(host, src[:, :, src_ids].permute(2, 0, 1, 3, 4, 5).cpu()), name
        row["read_kernel_ms"] = _median_ms(read_kernel)
        row["gb"] = nbytes / 1e9
        rows[name] = row
        print(name, {k: round(v, 3) for k, v in row.items()},
              {k.replace("_ms", "_gb_s"): round(nbytes / 1e6 / v, 1)
               for k, v in row.items() if k.endswith("_ms")})
    doc = {**git_info(), "gpu": torch.cuda.get_device_name(), "blocks": n, "shape": SHAPE,
           "dtype": "bfloat16", "results": rows,
           "command": f"PYTHONPATH=. python3 tools/probes/probe_kv_dma.py --blocks {n} "
                      f"--streams {args.streams} --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
