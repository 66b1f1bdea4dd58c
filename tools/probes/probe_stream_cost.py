"""Does work on another CUDA stream slow the decode graphs' replays? (run on the H200)

Batch-8 decode at 1k context (8 fresh 1024-token prompts, 128 tokens each; the median gap
between `LLMEngine.step()` returns after the first 5), twice; then one `--variant` action;
then twice more. The effect found persists for the rest of the process, so run one variant per
process. Variants:

    none            nothing (the control)
    side_kernel     three in-place kernels on the runner's capture stream
    new_stream      three in-place kernels on a new stream
    side_alloc      a tensor allocated on the capture stream, no kernel
    side_wait       the streams wait on each other, no kernel
    side_copy_d2d   a device-to-device copy (copy engine) on the capture stream
    side_copy_h2d   a pinned host-to-device copy on the capture stream
    side_graph      a one-kernel CUDA graph (captured on a new stream) replayed on that stream
    thread_kernel   three in-place kernels on the engine's stream from another thread
    kv_copy         the runner's own KV handoff copy (`copy_blocks_from`, 4 blocks)
    kv_read         the runner's own leased-block read (`read_leased_blocks`, 4 blocks)

`--engine-stream` builds and runs the engine on a stream of its own instead of the default one.

Usage: PYTHONPATH=. python3 tools/probes/probe_stream_cost.py --variant side_kernel --out F
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from bench.results import git_info
from tools.probes import probe_ttft

VARIANTS = ("none", "side_kernel", "new_stream", "side_alloc", "side_wait", "side_copy_d2d",
            "side_copy_h2d", "side_graph", "thread_kernel", "kv_copy", "kv_read")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--variant", choices=VARIANTS, default="none")
    p.add_argument("--piecewise-graph-max-tokens", type=int, default=None,
                   help="the engine's piecewise graphs (default: the engine's; 0: off)")
    p.add_argument("--engine-stream", action="store_true",
                   help="build and step the engine on a stream of its own")
    args = p.parse_args()

    import torch

    from engine import SamplingParams
    from engine.dma_copy import dma_available

    if args.engine_stream:
        torch.cuda.set_stream(torch.cuda.Stream())
    llm = probe_ttft.build_llm(args.model, args.piecewise_graph_max_tokens)
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.model_config.vocab_size
    rng = random.Random(5)
    rounds = [0]

    def decode_gap_ms() -> float:
        rounds[0] += 1
        for i in range(8):
            engine.add_request(f"r{rounds[0]}_{i}", [rng.randrange(vocab) for _ in range(1024)],
                               SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
        gaps, t = [], None
        while engine.has_unfinished_requests():
            engine.step()
            now = time.perf_counter()
            if t is not None:
                gaps.append((now - t) * 1e3)
            t = now
        return statistics.median(gaps[5:])

    before = [decode_gap_ms(), decode_gap_ms()]
    side = runner.capture_stream
    x = torch.zeros(16, 4096, device="cuda", dtype=torch.bfloat16)
    host = torch.zeros(16, 4096, dtype=torch.bfloat16, pin_memory=True)
    v = args.variant
    extra: dict[str, object] = {}
    if v in ("side_kernel", "new_stream"):
        with torch.cuda.stream(side if v == "side_kernel" else torch.cuda.Stream()):
            for _ in range(3):
                x.mul_(1)
    elif v == "side_alloc":
        with torch.cuda.stream(side):
            kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del kept
    elif v == "side_wait":
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(side)
    elif v == "side_copy_d2d":
        y = torch.empty_like(x)
        with torch.cuda.stream(side):
            y.copy_(x)
    elif v == "side_copy_h2d":
        with torch.cuda.stream(side):
            x.copy_(host, non_blocking=True)
    elif v == "side_graph":
        other = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=other):
            x.mul_(1)
        with torch.cuda.stream(other):
            graph.replay()
    elif v == "thread_kernel":
        engine_stream = torch.cuda.current_stream()

        def launch() -> None:
            with torch.cuda.stream(engine_stream):
                for _ in range(3):
                    x.mul_(1)

        worker = threading.Thread(target=launch)
        worker.start()
        worker.join()
    elif v in ("kv_copy", "kv_read"):
        # Blocks no request of this probe holds, filled with random values first; the copy's
        # destinations run backwards, so every block is a run of its own.
        last = runner.kv_cache.shape[2] - 1
        src_ids, dst_ids = [last - 7, last - 6, last - 5, last - 4], [last - i for i in range(4)]
        cache = runner.kv_cache.view(torch.uint8)
        cache[:, :, src_ids] = torch.randint_like(cache[:, :, src_ids], 0, 256)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if v == "kv_copy":
            runner.copy_blocks_from(dst_ids, runner.kv_cache, src_ids)
            exact = torch.equal(cache[:, :, dst_ids], cache[:, :, src_ids])
        else:
            host = runner.read_leased_blocks(src_ids)
            exact = torch.equal(host.view(torch.uint8),
                                cache[:, :, src_ids].permute(2, 0, 1, 3, 4, 5).cpu())
        extra = {"copy_ms": (time.perf_counter() - t0) * 1e3, "copy_exact": exact,
                 "dma": dma_available()}
    torch.cuda.synchronize()
    after = [decode_gap_ms(), decode_gap_ms()]
    doc = {**git_info(), "gpu": torch.cuda.get_device_name(), "model": args.model,
           "variant": v, "engine_stream": args.engine_stream, "piecewise_graph_max_tokens":
               engine.config.runner.piecewise_graph_max_tokens,
           "decode_gap_ms_before": before, "decode_gap_ms_after": after, **extra}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{v}{' (engine stream)' if args.engine_stream else ''}: batch-8 decode step {statistics.mean(before):.3f} -> "
          f"{statistics.mean(after):.3f} ms {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
