"""Host time of the engine's steps on the GPU machine (run on the H200).

1. A full batch of decoding requests (default 384 of 1,000 prompt tokens, bf16): the median
   host time of each phase of a step (schedule, input preparation, graph replay or forward,
   sampling launch, the wait for the previous step's tokens, the output update), the device
   time of the step from CUDA events, and the synchronizing CUDA calls made in one step
   (`torch.cuda.set_sync_debug_mode`, with the calling line).
2. cProfile of the decode steps and of `generate` of one fresh 4096-token prompt (the
   time-to-first-token path).

Usage: PYTHONPATH=. python3 tools/probes/probe_host.py --out F [--batch 384] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import offline
from bench.results import git_info
from tools.profiling import profile_text, sync_calls


def _timed(parts: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name].append((time.perf_counter() - t) * 1e3)
    return wrapper


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()

    import torch

    from engine import SamplingParams

    llm = offline.build_llm(offline.EngineSettings(
        model=args.model, dtype="bfloat16", max_model_len=8192, max_num_seqs=args.batch,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.92,
        kv_cache_dtype=args.kv_cache_dtype))
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"h{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()

    parts: dict[str, list[float]] = defaultdict(list)
    runner = eng.runner
    originals = {"schedule": (eng.scheduler, "schedule"), "prepare": (runner, "prepare"),
                 "graph_run": (runner.graphs, "run"), "sample": (runner.sampler, "sample"),
                 "finish_prev": (eng, "_finish_step"),
                 "update": (eng.scheduler, "update_from_output")}
    saved = {name: getattr(obj, attr) for name, (obj, attr) in originals.items() if obj is not None}
    for name, (obj, attr) in originals.items():
        if obj is not None:
            setattr(obj, attr, _timed(parts, name, saved[name]))
    walls, gpu = [], []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        eng.step()
        end.record()
        walls.append((time.perf_counter() - t) * 1e3)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    # The events above synchronise each step: these phases are a lower bound of the async
    # run's. The wall time per step of an unsynchronised run follows.
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    async_ms = (time.perf_counter() - t) / args.steps * 1e3
    for name, (obj, attr) in originals.items():
        if obj is not None:
            setattr(obj, attr, saved[name])

    def two_steps() -> None:
        for _ in range(2):
            eng.step()

    syncs = sync_calls(two_steps)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        eng.step()
    prof.disable()
    decode_profile = profile_text(prof, "tottime", 35)
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests() or eng.has_step_in_flight:
        eng.step()

    one = SamplingParams(temperature=0.0, max_tokens=1)
    for _ in range(2):
        llm.generate([{"prompt_token_ids": [rng.randrange(vocab) for _ in range(4096)]}], one)
    ids = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(4096)]}]
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(ids, one)
    prof.disable()
    ttft_profile = profile_text(prof, "cumulative", 45)

    doc = {
        **git_info(), "gpu": torch.cuda.get_device_name(), "settings": vars(args),
        "phase_ms_median": {k: round(statistics.median(v), 3) for k, v in parts.items()},
        "phase_calls": {k: len(v) for k, v in parts.items()},
        "step_wall_ms_median_synced": round(statistics.median(walls), 3),
        "step_gpu_ms_median": round(statistics.median(gpu), 3),
        "step_wall_ms_async": round(async_ms, 3),
        "sync_calls_in_2_steps": syncs,
        "decode_cprofile": decode_profile,
        "ttft_cprofile": ttft_profile,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if "cprofile" not in k}, indent=1))
    print(decode_profile)
    print(ttft_profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
