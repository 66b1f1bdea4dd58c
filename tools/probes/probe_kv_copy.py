"""KV block copies beside a busy engine (GPU): what a disaggregated pull costs each side while
the worker's engine keeps stepping.

An engine decodes a batch in a background thread (as a worker's engine thread does); the main
thread copies 64 free blocks the way the transfer layer does:

- prefill side, reading a lease block by block: `read_blocks` (through the engine's stream:
  each copy waits for the steps queued before it) against `read_leased_blocks` (a side stream);
- decode side, writing pulled blocks: one `write_blocks` call per block against batches of
  `WRITE_BATCH_BLOCKS` (each call waits for the queued steps: a freed block may still be
  written by a step in flight).

Usage: PYTHONPATH=. python3 tools/probes/probe_kv_copy.py --out F [--model dummy:llama-3.1-8b]
       [--batch 128] [--blocks 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable

import torch

from bench.results import git_info
from engine import LLM, SamplingParams
from kv_transfer import WRITE_BATCH_BLOCKS


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM(model=args.model, max_model_len=4096, seed=1, max_num_seqs=args.batch,
              gpu_memory_utilization=0.6)
    runner = llm.engine.runner
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(512)]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    # Blocks at the top of the cache: free while the batch runs (it takes the lowest ids).
    ids = list(range(runner.result.num_blocks - args.blocks, runner.result.num_blocks))
    data = runner.read_blocks(ids)
    busy = threading.Thread(target=llm.generate, args=(prompts, params), daemon=True)
    busy.start()
    time.sleep(4.0)  # the prompts are in; the batch decodes
    steps0, t0 = llm.engine.num_steps, time.perf_counter()
    rows: dict[str, list[float]] = {"read_per_block_engine_stream_ms": [],
                                    "read_per_block_side_stream_ms": [],
                                    "write_per_block_ms": [], "write_batched_ms": []}
    def read_engine_stream() -> None:
        for b in ids:
            runner.read_blocks([b])

    def read_side_stream() -> None:
        for b in ids:
            runner.read_leased_blocks([b])

    def write_per_block() -> None:
        for i, b in enumerate(ids):
            runner.write_blocks([b], data[i:i + 1])

    def write_batched() -> None:
        for i in range(0, len(ids), WRITE_BATCH_BLOCKS):
            runner.write_blocks(ids[i:i + WRITE_BATCH_BLOCKS], data[i:i + WRITE_BATCH_BLOCKS])

    for _ in range(args.repeats):
        rows["read_per_block_engine_stream_ms"].append(_timed(read_engine_stream))
        rows["read_per_block_side_stream_ms"].append(_timed(read_side_stream))
        rows["write_per_block_ms"].append(_timed(write_per_block))
        rows["write_batched_ms"].append(_timed(write_batched))
    elapsed = time.perf_counter() - t0
    step_ms = elapsed * 1e3 / max(1, llm.engine.num_steps - steps0)
    summary = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    doc = {"model": args.model, "batch": args.batch, "blocks": args.blocks,
           "write_batch_blocks": WRITE_BATCH_BLOCKS, "engine_step_ms_during": round(step_ms, 2),
           "block_bytes": runner.block_bytes, "median": summary, "runs": rows,
           "engine_still_running": busy.is_alive(),
           "gpu": torch.cuda.get_device_name(), "git": git_info(),
           "command": f"PYTHONPATH=. python3 tools/probes/probe_kv_copy.py --batch {args.batch} "
                      f"--blocks {args.blocks} --out F"}
    print(json.dumps(doc["median"]), "step ms", doc["engine_step_ms_during"],
          "running", doc["engine_still_running"])
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    os._exit(0)  # the engine thread is still decoding: do not wait for it or tear it down


if __name__ == "__main__":
    raise SystemExit(main())
