"""Does a copy-engine KV write on a side stream wait for kernels queued on the step stream?
(GPU; for `ModelRunner.fence_kv_loads`.)

`tests/unit/engine/test_kv_dma_copy.py::test_a_kv_load_lands_after_a_stale_write_from_a_launched_step`
passed on the H200, but so did the same sequence without the fence (a sleeping kernel, then a
fill of the block, on the default stream; then a pinned host-to-device DMA write of the block on
a side stream): the write still landed last. This probe found why (bench/results/h200/
block_runs/1_*): only a process's first DMA call waits for the device; every later copy ran
~100 ms ahead of the fill, so the test now warms up first and checks an unfenced control. For the default
stream and for a pool stream as the "step stream", twice each: the host's time to queue the
DMA write, whether it was done 10 ms later (while the 0.1 s kernel still runs), the device
time from the fill to the write's completion (negative: the write finished first), whether the
block kept the write; then the same question for torch's own `non_blocking` copy.

Usage: PYTHONPATH=. python3 tools/probes/probe_side_stream_order.py
"""

from __future__ import annotations

import time

import torch

from engine.dma_copy import write_blocks_dma


def main() -> int:
    cache = torch.zeros((2, 2, 8, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    blocks = torch.randn((1, 2, 2, 16, 8, 128), dtype=torch.bfloat16).pin_memory()
    side = torch.cuda.Stream()
    for case in ("default_stream", "pool_stream"):
        step = torch.cuda.default_stream() if case == "default_stream" else torch.cuda.Stream()
        for trial in range(2):
            cache.zero_()
            torch.cuda.synchronize()
            fill_done = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(step):
                torch.cuda._sleep(200_000_000)  # ~0.1 s: a step still running
                cache[:, :, 7].fill_(0)         # its write into the block
                fill_done.record(step)
            t = time.perf_counter()
            write_blocks_dma(cache, [7], blocks, side)
            dma_done = torch.cuda.Event(enable_timing=True)
            dma_done.record(side)
            issued_ms = (time.perf_counter() - t) * 1e3
            time.sleep(0.01)
            early = dma_done.query()
            torch.cuda.synchronize()
            print(case, trial, f"queued in {issued_ms:.3f} ms; done 10 ms later: {early}; "
                  f"fill -> write done {fill_done.elapsed_time(dma_done):.3f} ms; "
                  f"block kept the write: {torch.equal(cache[:, :, 7].cpu(), blocks[0])}",
                  flush=True)
        cache.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(step):
            torch.cuda._sleep(200_000_000)
            cache[:, :, 6].fill_(0)
        with torch.cuda.stream(side):
            blocks[0].to("cuda", non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
        time.sleep(0.01)
        print(case, f"torch's non_blocking copy on the side stream done 10 ms later: "
              f"{done.query()}", flush=True)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
