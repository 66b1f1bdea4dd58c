"""Replay a step trace (step_trace.py's steps.json, gzipped or not) through the step-cost model
as the engine records it (verify steps, and plain steps that overlapped the next launch;
start-up calibration left out of the context fit), and print: each change of the fitted
seconds per KV token of plain and of verify steps (step index, run); the share of steps after
the first hundred at which the plain slope was 0, and its largest value; and at the end per
shape of step (kind, rows, sequences; three steps or more) its own slope and weight (its
spread of KV tokens). With `--until RUN`: stop before RUN's first step and print the plain
step the model predicts for `--rows` sequences at `--kv` KV tokens (what the GPU probe's
prediction for that batch read). See README.md in this folder.

    PYTHONPATH=. python3 bench/results/h100/spec_policy_1205/replay_slope.py TRACE
    PYTHONPATH=. python3 bench/results/h100/spec_policy_1205/replay_slope.py \\
        11659cd_trace/steps.json.gz --until po128-0.6-0 --rows 128 --kv 73728
"""

import argparse
import gzip
import json
import statistics
from typing import Any

from engine.spec.cost import StepCostModel


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        steps: list[dict[str, Any]] = json.load(f)
    return steps


def print_shapes(model: StepCostModel) -> None:
    for kind, curve in (("plain", model.plain), ("verify", model.verify)):
        for _, bucket in sorted(curve.buckets.items()):
            for group in bucket.by_shape():
                kv = [k for _, k, _ in group]
                spread = sum((k - statistics.mean(kv)) ** 2 for k in kv)
                if len(group) < 3 or spread <= 0:
                    continue
                mean_s = statistics.mean(s for _, _, s in group)
                slope = sum((k - statistics.mean(kv)) * (s - mean_s)
                            for (_, k, s) in group) / spread
                print(f"{kind} rows {group[0][0]}: {len(group)} steps, KV {min(kv):.0f}-"
                      f"{max(kv):.0f}, slope {slope:.2e}, weight {spread:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--until", help="stop before this run's first step (e.g. po128-0.6-0)")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--kv", type=float, default=0.0)
    args = ap.parse_args()
    model = StepCostModel()
    last: tuple[float, float] | None = None
    zero = counted = 0
    largest = 0.0
    for i, s in enumerate(load(args.trace)):
        if args.until and s["run"] == args.until:
            seconds = model.cost(args.kv).seconds_at(args.rows)
            print(f"before {args.until}: plain step of {args.rows} rows at {args.kv:.0f} KV "
                  f"tokens {seconds * 1e3:.2f} ms")
            return
        verify = bool(s["drafts"] > 0 or s["padded"])
        if not verify and not s["async"]:
            continue  # a plain step held back for drafts: not recorded (llm_engine.py)
        model.fit_context = not s["run"].startswith("_cal")
        model.record(s["rows"], s["ms"] / 1e3, s["kv"], s["seqs"], verify)
        slopes = (model.per_kv_token, model.verify_per_kv_token)
        if slopes != last:
            last = slopes
            print(f"step {i} ({s['run']}): {slopes[0]:.3g} / {slopes[1]:.3g} s per KV token "
                  "(plain / verify steps)")
        if i > 100:
            counted += 1
            zero += model.per_kv_token == 0
            largest = max(largest, model.per_kv_token)
    if counted:
        print(f"after step 100: plain slope 0 at {zero / counted:.1%} of recorded steps, "
              f"at most {largest:.2g}")
    print_shapes(model)


if __name__ == "__main__":
    main()
