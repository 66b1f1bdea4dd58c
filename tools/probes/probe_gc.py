"""Full garbage collections against an offline run's live heap, on the CPU (no model, no GPU).

A full collection walks every tracked container alive, and an engine's live requests hold
long lists: the prompt, the output, prompt + output, and each token's time. This builds
`--requests` engine requests (`engine.request.Request`) of `--prompt-len` tokens, freezes what
existed before (as the engine freezes its startup heap), then runs `--steps` decode steps of
the engine's kind of churn: every request gets one token (output, all tokens, token time) and
each step allocates `--per-step` short-lived containers per request (step outputs, dicts and
lists; about 3 per sequence in the H200's offline run: 5,947 young collections of 700 objects
in ~1,950 steps of up to 768 sequences, probe_tput_fp8_768g_d18ba9a.json). Once with CPython's
default thresholds and once with the engine's (`DEFAULT_GC_THRESHOLD`); reports the
collections and their pause time per generation, and the time of one full collection at the end.

Usage: python3 tools/probes/probe_gc.py --out F [--requests 1000 --prompt-len 1000 --steps 1000]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

from bench.results import environment_info
from engine.config import DEFAULT_GC_THRESHOLD
from engine.request import Request
from engine_api.sampling_params import SamplingParams
from tools.profiling import GcPauses

CPYTHON_THRESHOLD = (700, 10, 10)


def run(threshold: tuple[int, int, int], requests: int, prompt_len: int, steps: int,
        per_step: int) -> dict[str, Any]:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*threshold)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    reqs = [Request(f"r{i}", list(range(i, i + prompt_len)), params) for i in range(requests)]
    start = time.perf_counter()
    with GcPauses() as pauses:
        for step in range(steps):
            now = time.perf_counter()
            churn = []
            for r in reqs:
                r.output_token_ids.append(step)
                r.all_token_ids.append(step)
                r.metrics.token_times.append(now)
                churn.append([{"token": step} for _ in range(per_step - 1)])
            del churn
    wall = time.perf_counter() - start
    t = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t) * 1e3
    del reqs
    gc.unfreeze()
    gc.set_threshold(*CPYTHON_THRESHOLD)
    gc.collect()
    return {"threshold": list(threshold), "wall_s": round(wall, 3), "gc": pauses.summary(),
            "one_full_collection_at_end_ms": round(full_ms, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--per-step", type=int, default=3, help="containers per request per step")
    args = p.parse_args()
    doc: dict[str, Any] = {**environment_info(), "settings": vars(args), "runs": []}
    for threshold in (CPYTHON_THRESHOLD, DEFAULT_GC_THRESHOLD):
        res = run(threshold, args.requests, args.prompt_len, args.steps, args.per_step)
        doc["runs"].append(res)
        print(json.dumps(res), flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
