"""Where a cold prefill's time goes on the CPU (SmolLM2, the embedded default model): each step
of one prompt's chunked prefill, optionally with torch's profiler's top operators.

This is how the slow cold prefills of `probe_tiers_cpu.py` were traced to the torch attention
backend's prefill path (SDPA fell back to its math kernel for strided [H, L, D] operands).

Usage: PYTHONPATH=. python3 tools/probes/probe_cpu_prefill.py [--lens 1000,4000] [--profile]
       [--out F]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from bench.results import environment_info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 4000])
    p.add_argument("--profile", action="store_true", help="profile the longest prompt")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from engine import SamplingParams
    from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    n_max = max(args.lens)
    engine = LLMEngine(EngineConfig(
        cache=CacheConfig(block_size=16, num_gpu_blocks=n_max // 16 + 64),
        scheduler=SchedulerConfig(role="colocated", max_model_len=n_max + 64),
        runner=RunnerConfig(device="cpu")), detokenize=False)
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size

    def prefill(n: int, tag: str) -> dict[str, Any]:
        engine.add_request(tag, [rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        steps, t0 = [], time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(round(time.perf_counter() - t, 2))
        return {"tokens": n, "seconds": round(time.perf_counter() - t0, 2), "steps_s": steps}

    prefill(256, "warm-up")
    doc: dict[str, Any] = {"threads": torch.get_num_threads(), "runs": []}
    for i, n in enumerate(args.lens):
        if args.profile and n == n_max:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                doc["runs"].append(prefill(n, f"p{i}"))
            doc["top_ops_self_cpu_s"] = {
                e.key: round(e.self_cpu_time_total / 1e6, 2)
                for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]}
        else:
            doc["runs"].append(prefill(n, f"p{i}"))
        print(json.dumps(doc["runs"][-1]), flush=True)
    if "top_ops_self_cpu_s" in doc:
        print(json.dumps(doc["top_ops_self_cpu_s"], indent=1))
    if args.out:
        doc["command"] = ("PYTHONPATH=. python3 tools/probes/probe_cpu_prefill.py --lens "
                          + ",".join(map(str, args.lens)) + (" --profile" if args.profile else ""))
        doc["environment"] = environment_info()
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
