"""First-token time of short prompts, and where the host spends it (run on the H200).

For each prompt length: `generate` of fresh random prompts (1 output token) timed unprofiled,
then one more under cProfile, whose top functions (by own time and by cumulative time) go to the
JSON. Short prompts run one eager step (bench/results/h200/ttft_short/), so the profile is the
host's side of that step: scheduling, input preparation, the layers' launches, the sync.

Usage: PYTHONPATH=. python3 tools/probes/probe_short_prompts.py --out F [--lens 16,128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.results import git_info
from tools.probes import probe_ttft


def _top(profile: cProfile.Profile, key: str, count: int) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats(key).print_stats(count)
    return [line for line in buf.getvalue().splitlines() if line.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--lens", default="16,128")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--piecewise-graph-max-tokens", type=int, default=None,
                   help="the engine's piecewise graphs (default: the engine's, 512; 0: off, "
                        "steps with prompt tokens run eagerly)")
    args = p.parse_args()
    lens = [int(n) for n in args.lens.split(",")]

    import torch

    from engine import SamplingParams

    llm = probe_ttft.build_llm(args.model, args.piecewise_graph_max_tokens)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt(n: int) -> list[dict[str, list[int]]]:  # fresh tokens: no prefix-cache hit
        return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}]

    def timed(n: int) -> float:
        ids = prompt(n)
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(ids, params)
        return (time.perf_counter() - t) * 1e3

    for n in lens:
        for _ in range(2):
            timed(n)
    results: dict[str, Any] = {}
    for n in lens:
        walls = [timed(n) for _ in range(args.repeats)]
        ids = prompt(n)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(ids, params)
        prof.disable()
        results[str(n)] = {"generate_ms": walls, "median_generate_ms": statistics.median(walls),
                           "by_own_time": _top(prof, "tottime", args.top),
                           "by_cumulative": _top(prof, "cumulative", args.top)}
        print(n, [round(w, 2) for w in walls])
    doc = {**git_info(), "gpu": torch.cuda.get_device_name(), "model": args.model,
           "piecewise_graph_max_tokens": llm.engine.config.runner.piecewise_graph_max_tokens,
           "piecewise_steps": (llm.engine.runner.piecewise.num_steps
                               if llm.engine.runner.piecewise is not None else 0),
           "repeats": args.repeats, "lengths": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for key, r in results.items():
        print(f"--- {key} tokens: median {r['median_generate_ms']:.2f} ms")
        print("\n".join(r["by_cumulative"][:30]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
