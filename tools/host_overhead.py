"""Host (CPU) time of one decode step's bookkeeping at a large batch, without a GPU.

Drives the real scheduler, input preparation, output update and offline-API accumulation for
`--batch` requests decoding at `--context` tokens, with sampled tokens made up (no forward pass),
and prints the mean and median milliseconds of each phase. This is the work a GPU step waits for unless
it is overlapped.

Usage: PYTHONPATH=. python tools/host_overhead.py [--batch 384] [--context 1000] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine import LLM, SamplingParams
from engine.scheduler import SampledToken


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    blocks = args.batch * (-(-(args.context + args.steps + 8) // 16)) + 16
    llm = LLM(model="dummy:tiny", max_model_len=2048, max_num_seqs=args.batch,
              max_num_batched_tokens=8192, num_gpu_blocks=blocks, cpu_threads=1)
    eng = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"r{i}", [rng.randrange(500) for _ in range(args.context)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in eng.scheduler.requests.values()):  # prefill, bookkeeping only
        out = eng.scheduler.schedule()
        eng.scheduler.update_from_output(
            out, {s.request.request_id: SampledToken(7) for s in out.scheduled if s.sample})
    phases: dict[str, list[float]] = {"schedule": [], "prepare": [], "update": [], "outputs": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = eng.scheduler.schedule()
        t1 = time.perf_counter()
        eng.runner.prepare(out)
        t2 = time.perf_counter()
        changed = eng.scheduler.update_from_output(
            out, {s.request.request_id: SampledToken(7) for s in out.scheduled})
        t3 = time.perf_counter()
        for step in [eng._step_output(r, toks) for r, toks in changed]:
            llm._accumulate(step)
        t4 = time.perf_counter()
        for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name].append(dt * 1e3)
    # Means matter for throughput: every 16th step all blocks fill at once and get hashed.
    doc: dict[str, object] = {"batch": args.batch, "context": args.context, "steps": args.steps}
    for stat, fn in (("mean_ms", statistics.mean), ("median_ms", statistics.median)):
        values = {name: round(fn(v), 3) for name, v in phases.items()}
        values["total"] = round(sum(values.values()), 3)
        doc[stat] = values
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
