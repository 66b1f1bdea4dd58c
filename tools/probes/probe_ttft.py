"""Where the time-to-first-token of one long prompt goes (run on the H200).

Profiles `generate` of one fresh prompt (default 4096 tokens, 1 output token) with
torch.profiler and splits its wall time into: host time before the first kernel, kernel time
(the union of kernel intervals), device idle gaps between kernels (with the kernels on either
side of the largest ones), and host time after the last kernel. Kernel totals by name too, and
the synchronizing CUDA calls of one more (unprofiled) `generate`.

Usage: PYTHONPATH=. python3 tools/probes/probe_ttft.py --out F [--input-len 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench import offline
from bench.results import git_info
from tools.profiling import GcPauses, rank_by_name, sync_calls

MARK = "ttft_generate"


def _analyse(kernels: list[tuple[float, float, str]], wall_us: float, t0_us: float) -> dict[str, Any]:
    """Kernel intervals (start, end, name) in µs on the profiler clock; t0 = generate's start."""
    kernels.sort()
    busy = 0.0
    gaps: list[tuple[float, str, str]] = []
    cur_start, cur_end, last_name = kernels[0][0], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, last_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, last_name = end, name
    busy += cur_end - cur_start
    gaps.sort(reverse=True)
    return {
        "wall_ms": wall_us / 1e3,
        "host_before_first_kernel_ms": (kernels[0][0] - t0_us) / 1e3,
        "kernel_busy_ms": busy / 1e3,
        "idle_gaps_ms": sum(g for g, _, _ in gaps) / 1e3,
        "idle_gaps": len(gaps),
        "after_last_kernel_ms": (t0_us + wall_us - cur_end) / 1e3,
        "largest_gaps": [{"us": round(g, 1), "after": a[:60], "before": b[:60]}
                         for g, a, b in gaps[:12]],
        "kernels": rank_by_name(((n, (e - s) / 1e3) for s, e, n in kernels), 20, 80),
    }


def build_llm(model: str, piecewise_graph_max_tokens: int | None = None) -> Any:
    """The engine both first-token probes time (this one and probe_short_prompts.py);
    `piecewise_graph_max_tokens` None: the engine's default."""
    settings = offline.EngineSettings(
        model=model, dtype="bfloat16", max_model_len=8192, max_num_seqs=384,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.92)
    if piecewise_graph_max_tokens is not None:
        settings = dataclasses.replace(settings,
                                       piecewise_graph_max_tokens=piecewise_graph_max_tokens)
    return offline.build_llm(settings)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    llm = build_llm(args.model)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(7)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt() -> list[dict[str, list[int]]]:  # fresh tokens: no prefix-cache hit
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}]

    for _ in range(2):
        llm.generate(prompt(), params)
    plain, plain_gc = [], []
    for _ in range(args.repeats):  # unprofiled reference
        ids = prompt()
        torch.cuda.synchronize()
        with GcPauses() as pauses:
            t = time.perf_counter()
            llm.generate(ids, params)
            plain.append((time.perf_counter() - t) * 1e3)
        plain_gc.append(pauses.summary())
    ids = prompt()
    syncs = sync_calls(lambda: llm.generate(ids, params))
    runs = []
    for _ in range(args.repeats):
        ids = prompt()
        torch.cuda.synchronize()
        with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
              GcPauses() as pauses):
            with torch.profiler.record_function(MARK):
                llm.generate(ids, params)
            torch.cuda.synchronize()
        events = prof.events()
        # The mark shows up twice: the host range, and its span on the device timeline.
        outer = next(e for e in events if e.name == MARK and e.device_type.name == "CPU")
        kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type.name == "CUDA" and e.name != MARK
                   and e.time_range.start >= outer.time_range.start]
        runs.append({**_analyse(kernels, outer.time_range.elapsed_us(), outer.time_range.start),
                     "gc": pauses.summary()})
    doc = {**git_info(), "gpu": torch.cuda.get_device_name(), "input_len": args.input_len,
           "generate_ms_unprofiled": plain, "gc_unprofiled": plain_gc,
           "median_generate_ms_unprofiled": statistics.median(plain), "profiled": runs,
           "sync_calls_in_one_generate": syncs}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for r in runs:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
               if k not in ("largest_gaps", "kernels")})
    print(json.dumps(runs[-1]["largest_gaps"], indent=1))
    print(json.dumps(runs[-1]["kernels"], indent=1))
    print("unprofiled generate ms", plain, plain_gc)
    print("synchronizing calls in one generate:", json.dumps(syncs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
