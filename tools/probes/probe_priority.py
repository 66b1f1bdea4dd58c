"""Urgent requests arriving behind a backlog: first come, first served against priority
scheduling (engine/request_queue.py).

For each policy, one engine: `--background` requests are queued at once (priority 1 under
"priority"), the engine steps `--inject-after` times, then `--urgent` requests arrive (priority
0) and the engine runs until everything finished. Reported per class (background, urgent):
time to first token and end-to-end latency from each request's own arrival (median, p99),
plus the run's duration, output tokens per second and preemptions. Under FCFS the urgent
requests wait for the backlog's seats; under "priority" they preempt background requests.

Usage: PYTHONPATH=. python3 tools/probes/probe_priority.py --out F [--model dummy:llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import git_info
from engine import LLM, SamplingParams
from engine.request import RequestMetrics


def _stats(metrics: list[RequestMetrics]) -> dict[str, float]:
    ttft = [(m.first_token_time or 0.0) - m.arrival_time for m in metrics]
    e2e = [(m.finished_time or 0.0) - m.arrival_time for m in metrics]
    return {"n": len(metrics),
            "median_ttft_ms": statistics.median(ttft) * 1e3,
            "p99_ttft_ms": float(np.percentile(ttft, 99)) * 1e3,
            "median_e2e_ms": statistics.median(e2e) * 1e3,
            "p99_e2e_ms": float(np.percentile(e2e, 99)) * 1e3}


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, device=args.device,
              scheduling_policy=policy)
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(5)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    # Warm-up (kernels, graphs' first replays), then the measured run.
    eng.add_request("warm", prompt(args.urgent_input), params(4))
    while eng.has_unfinished_requests():
        eng.step()
    bg_prio, urgent_prio = (1, 0) if policy == "priority" else (0, 0)
    reqs = {}
    t0 = time.perf_counter()
    for i in range(args.background):
        reqs[f"bg{i}"] = eng.add_request(f"bg{i}", prompt(args.bg_input),
                                         params(args.bg_output), priority=bg_prio)
    for _ in range(args.inject_after):
        eng.step()
    for i in range(args.urgent):
        reqs[f"urgent{i}"] = eng.add_request(f"urgent{i}", prompt(args.urgent_input),
                                             params(args.urgent_output), priority=urgent_prio)
    while eng.has_unfinished_requests():
        eng.step()
    duration = time.perf_counter() - t0
    out_tokens = sum(r.num_output_tokens for r in reqs.values())
    doc = {"policy": policy, "duration_s": duration, "output_tok_s": out_tokens / duration,
           "preemptions": eng.scheduler.num_preemptions,
           "background": _stats([r.metrics for k, r in reqs.items() if k.startswith("bg")]),
           "urgent": _stats([r.metrics for k, r in reqs.items() if k.startswith("urgent")])}
    llm.shutdown()
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--background", type=int, default=512)
    p.add_argument("--bg-input", type=int, default=1000)
    p.add_argument("--bg-output", type=int, default=256)
    p.add_argument("--urgent", type=int, default=16)
    p.add_argument("--urgent-input", type=int, default=512)
    p.add_argument("--urgent-output", type=int, default=64)
    p.add_argument("--inject-after", type=int, default=100,
                   help="engine steps between the backlog's arrival and the urgent requests'")
    p.add_argument("--policies", default="fcfs,priority")
    args = p.parse_args()
    runs = [run_policy(policy, args) for policy in args.policies.split(",")]
    doc = {**git_info(), "settings": vars(args), "runs": runs}
    try:
        import torch
        if torch.cuda.is_available():
            doc["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for r in runs:
        print(r["policy"], {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                            if k not in ("background", "urgent", "policy")})
        for cls in ("background", "urgent"):
            print("   ", cls, {k: round(v, 1) for k, v in r[cls].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
