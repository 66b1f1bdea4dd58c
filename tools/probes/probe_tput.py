"""Where the offline random-throughput run spends its time (run on the H200).

Drives the engine step by step over the `random` workload (all requests at once, greedy, forced
lengths) and records every step's composition (decode rows, prefill tokens, running requests)
and wall time, then sums the time of pure-decode steps by batch size and of steps that carry
prefill. Optionally takes a torch.profiler kernel table of a few full-batch decode steps
(replayed CUDA graphs included: CUPTI reports their kernels) and of the first prefill steps.

With async scheduling a step call's wall time is its own host work plus the wait for the
previous step's tokens, so a step's time is attributed to the step launched in that call; over
thousands of steps the sums are what each kind of step costs.

Usage: PYTHONPATH=. python3 tools/probes/probe_tput.py --out F [--kv-cache-dtype fp8] [--max-num-seqs N]
       [--num-prompts 1000 --input-len 1000 --output-len 1000] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import offline
from bench.results import git_info
from bench.workloads import random_requests
from tools.profiling import GcPauses, rank_by_name


def _kernel_table(prof: Any, device: str, rows: int = 25) -> list[dict[str, Any]]:
    """The `rows` kernels with the most device time: name, calls, total ms."""
    return rank_by_name(((e.name, e.time_range.elapsed_us() / 1e3) for e in prof.events()
                         if e.device_type.name == device), rows)


def _bucket(batch: int) -> str:
    for top in (1, 8, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024):
        if batch <= top:
            return f"<={top}"
    return ">1024"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=384)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--cuda-graph-max-batch", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--profile", action="store_true", help="kernel tables of a few steps")
    p.add_argument("--gc-threshold", default="engine", choices=["engine", "none"],
                   help="engine: the engine's default GC thresholds; none: CPython's (A/B)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8", "int8"],
                   help="fp8: W8A8 weights and activations; int8: weight-only")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams
    from engine.config import DEFAULT_GC_THRESHOLD

    settings = offline.EngineSettings(
        model=args.model, dtype=args.dtype, max_model_len=8192, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
        cuda_graph_max_batch=args.cuda_graph_max_batch, quantization=args.quantization,
        gc_threshold=DEFAULT_GC_THRESHOLD if args.gc_threshold == "engine" else None)
    llm = offline.build_llm(settings)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    # Warm-up (other prompts: no prefix-cache hits for the measured ones).
    offline.generate(llm, random_requests(16, args.input_len, 8, vocab, seed=999))
    sync()

    composition: list[tuple[int, int, int]] = []  # (decode rows, prefill tokens, running)
    schedule = eng.scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        decode = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        composition.append((decode, out.num_batched_tokens - decode,
                            len(eng.scheduler.running)))
        return out

    eng.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    compiles: list[dict[str, Any]] = []  # Triton JIT compiles during the run, by step

    def on_compile(**kw: Any) -> None:
        compiles.append({"step": len(composition) - 1, "kernel": getattr(kw.get("fn"), "name", "?"),
                         "repr": str(kw.get("repr"))[:400]})

    import triton

    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        knobs.runtime.jit_post_compile_hook = on_compile
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i, req in enumerate(random_requests(args.num_prompts, args.input_len, args.output_len,
                                            vocab, seed=0)):
        eng.add_request(f"t{i}", req.prompt_token_ids, params)
    replays0 = eng.runner.graphs.num_replays if eng.runner.graphs is not None else 0
    preempt0 = eng.scheduler.num_preemptions
    walls: list[float] = []
    tables: dict[str, Any] = {}
    pauses = GcPauses().__enter__()
    start = time.perf_counter()
    while eng.has_unfinished_requests() or eng.has_step_in_flight:
        n = len(composition)
        want = None
        last = composition[-1] if composition else (0, 0, 0)
        if args.profile and "prefill" not in tables and n == 2:
            want = "prefill"
        elif (args.profile and "mixed" not in tables and n > 100 and last[1] > 0
              and last[0] >= args.max_num_seqs // 2):
            want = "mixed"
        elif (args.profile and "decode_full" not in tables and n > 100 and last[1] == 0
              and last[0] >= args.max_num_seqs * 0.95):
            want = "decode_full"
        if want is not None:
            with profile(activities=[activity]) as prof:
                t = time.perf_counter()
                for _ in range(3):
                    eng.step()
                sync()
                walls.extend([(time.perf_counter() - t) / 3] * 3)
            tables[want] = {"steps": [composition[-k] for k in (3, 2, 1)],
                            "wall_ms_per_step": round(walls[-1] * 1e3, 3),
                            "kernels": _kernel_table(prof, "CUDA" if cuda else "CPU")}
            continue
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    duration = time.perf_counter() - start
    pauses.__exit__(None, None, None)
    sync()

    by_bucket: dict[str, list[float]] = defaultdict(list)
    prefill_s = prefill_tokens = 0.0
    prefill_steps = 0
    for (decode, prefill, _), wall in zip(composition, walls, strict=False):
        if prefill == 0:
            by_bucket[_bucket(decode)].append(wall)
        else:
            prefill_s += wall
            prefill_tokens += prefill
            prefill_steps += 1
    decode_rows = {
        b: {"steps": len(w), "total_s": round(sum(w), 3),
            "median_ms": round(statistics.median(w) * 1e3, 3)}
        for b, w in sorted(by_bucket.items(), key=lambda kv: int(kv[0].strip("<=>")))}
    output_tokens = args.num_prompts * args.output_len
    doc = {
        **git_info(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "settings": vars(args),
        "kv_num_blocks": eng.scheduler.kv.num_blocks,
        "duration_s": round(duration, 3),
        "output_tok_s": round(output_tokens / duration, 1),
        "steps": len(composition),
        "graph_replays": (eng.runner.graphs.num_replays - replays0
                          if eng.runner.graphs is not None else 0),
        "preemptions": eng.scheduler.num_preemptions - preempt0,
        "steps_with_prefill": {"steps": prefill_steps, "total_s": round(prefill_s, 3),
                               "prefill_tokens": int(prefill_tokens)},
        "pure_decode_by_batch": decode_rows,
        "gc": pauses.summary(),
        "triton_compiles": compiles,
        "profiles": tables,
        # Per step: decode rows, prefill tokens, running requests, wall ms of its step call.
        "per_step": [[d, pf, r, round(w * 1e3, 2)]
                     for (d, pf, r), w in zip(composition, walls, strict=False)],
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items()
                      if k not in ("profiles", "per_step", "triton_compiles")}, indent=1))
    for c in compiles:
        print("compiled at step", c["step"], c["repr"][:300])
    for name, tab in tables.items():
        print(name, tab["steps"], tab["wall_ms_per_step"], "ms a step;",
              round(sum(r["ms"] for r in tab["kernels"]) / 3, 3), "ms of kernels a step")
        for row in tab["kernels"][:15]:
            print(f"  {row['ms']:9.3f} ms {row['calls']:5d}  {row['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
