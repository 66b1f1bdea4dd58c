"""Replay `step_cost_by_workload_steps.json` (code edits' steps, then stories', as recorded by
step_cost_by_workload.py) through the step-cost model as it is now, without running the model
again: the fitted seconds per KV token of plain and of verify steps, and per rows bucket of the
stories (rows rounded down to 8) the measured median against what the model predicts at the
stories' context, and the largest relative miss.

    PYTHONPATH=. python3 bench/results/cpu_spec_budget_trace/replay_steps.py
"""

import collections
import json
import statistics
from pathlib import Path

from engine.spec.cost import StepCostModel

STEPS = Path(__file__).with_name("step_cost_by_workload_steps.json")


def main() -> None:
    runs = json.loads(STEPS.read_text())
    model = StepCostModel()
    for rows, kv, seqs, seconds, verify in runs["code"] + runs["text"]:
        model.record(rows, seconds, kv, seqs, verify)
    print(f"seconds per KV token: plain {model.per_kv_token:.3g}, "
          f"verify {model.verify_per_kv_token:.3g}")
    by_rows: dict[int, list[list[float]]] = collections.defaultdict(list)
    for step in runs["text"]:
        by_rows[int(step[0]) // 8 * 8].append(step)
    worst = 0.0
    print("stories: rows, steps, measured ms, predicted ms")
    for r, steps in sorted(by_rows.items()):
        measured = statistics.median(s[3] for s in steps)
        kv = statistics.median(s[1] for s in steps)
        predicted = model.cost(kv).seconds_at(r + 4, verify=r > 0)  # rows < 8: plain steps
        worst = max(worst, abs(predicted / measured - 1))
        print(f"  {r:4d} {len(steps):4d} {measured * 1e3:7.1f} {predicted * 1e3:7.1f}")
    print(f"largest miss {worst:.1%}")


if __name__ == "__main__":
    main()
