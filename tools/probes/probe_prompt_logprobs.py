"""What scoring a prompt (`prompt_logprobs`) costs against plain prefill (run on the H200).

Scoring makes logits for every prompt row (a 4096 x 128k bf16 LM head matmul, its log-softmax
and top-k), 512 rows at a time, and computes the prompt whole (no prefix-cache hits). Times, on
fresh random prompts (so the unscored runs get no cache hits either):

- one prompt of `--input-len` tokens, 1 output token, unscored / scored with k = 0 / k = 5;
- a batch of `--batch` prompts of `--batch-len` tokens (as lm-eval sends them), unscored and
  scored with k = 1 (lm-eval's `logprobs=1`).

`--profile F`: also profile one scored (k = 5) single prompt with torch.profiler and write its
kernel and host-op tables to F.

Usage: PYTHONPATH=. python3 tools/probes/probe_prompt_logprobs.py --out F [--model M] [--repeats 5]
       [--profile F]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench import offline
from bench.results import git_info
from engine import SamplingParams


def _time(llm: Any, prompts: list[list[int]], k: int | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=k)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t
    if k is not None:  # what was timed is what was asked for
        assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts, strict=True))
    return elapsed


def _profile(llm: Any, prompts: list[list[int]], path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        elapsed = _time(llm, prompts, 5)
    table = prof.key_averages()
    Path(path).write_text(
        f"one scored prompt of {len(prompts[0])} tokens, k = 5: {elapsed * 1e3:.2f} ms profiled\n\n"
        + table.table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()
    llm = offline.build_llm(offline.EngineSettings(
        model=args.model, max_model_len=args.max_model_len, max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]

    cases: dict[str, tuple[int, int, int | None]] = {
        "single_unscored": (1, args.input_len, None),
        "single_scored_k0": (1, args.input_len, 0),
        "single_scored_k5": (1, args.input_len, 5),
        "batch_unscored": (args.batch, args.batch_len, None),
        "batch_scored_k1": (args.batch, args.batch_len, 1),
    }
    for n, length, k in cases.values():  # warm-up: Triton autotuning, graphs, allocator
        _time(llm, fresh(n, length), k)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift (clocks, power) hits every case
        for name, (n, length, k) in cases.items():
            times[name].append(_time(llm, fresh(n, length), k))
    results = {name: {"median_ms": round(statistics.median(v) * 1e3, 2),
                      "min_ms": round(min(v) * 1e3, 2), "runs_ms": [round(x * 1e3, 2) for x in v]}
               for name, v in times.items()}
    if args.profile:
        _profile(llm, fresh(1, args.input_len), args.profile)
    doc = {**git_info(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "model": args.model,
           "input_len": args.input_len, "batch": args.batch, "batch_len": args.batch_len,
           "repeats": args.repeats, "results": results,
           "command": "PYTHONPATH=. python3 tools/probes/probe_prompt_logprobs.py --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
