"""Summarise an H200 run: `$OUT/suite.json` (+ `$OUT/kernels.json`) → `$OUT/h200_<model>.json`.

The summary holds the headline numbers, a goal for each, and the gap to it. Goals are taken
from the reference points in docs/performance.md (the design note's §7, which the goals'
`source` strings cite) where there is a measured one, else estimated from the hardware
(noted per goal); `direction` says whether lower or higher is better.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal

from bench.results import git_info, write_json

Direction = Literal["lower", "higher"]

# name → (goal, direction, where the goal comes from)
GOALS: dict[str, tuple[float, Direction, str]] = {
    "itl_ms_bs1": (4.4, "lower", "issue goal; floor 3.99 ms (all weights once through cuBLAS), "
                                 "plain-PyTorch CUDA graph 5.99 ms (docs/performance.md)"),
    "itl_ms_bs1_eager": (14.4, "lower", "plain-PyTorch decode step, eager, bs1 (docs/performance.md)"),
    "ttft_ms_4096": (100.0, "lower", "issue goal; compute floor ~78 ms, plain PyTorch + SDPA "
                                     "flash 109 ms (docs/performance.md)"),
    "output_tok_s_random_1000x1000": (15_000.0, "higher", "issue goal"),
    "output_tok_s_128x512x128": (
        1_231.0, "higher", "must beat the transformers baseline at batch 128 (1,231 tok/s in "
                           "docs/performance.md; the same run's baseline is hf_output_tok_s_128x512x128)"),
    "hf_output_tok_s_128x512x128": (1_231.0, "higher",
                                    "transformers generate bs128 reference (docs/performance.md)"),
}


def _step(suite: dict[str, Any], name: str) -> dict[str, Any] | None:
    entry = suite.get("steps", {}).get(name)
    return entry["result"] if entry and entry.get("ok") else None


def _dig(d: dict[str, Any] | None, *keys: str) -> float | None:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return float(d) if isinstance(d, (int, float)) else None


def headline(suite: dict[str, Any]) -> dict[str, float | None]:
    """The summary numbers (None where the step failed or did not run)."""
    return {
        "itl_ms_bs1": _dig(_step(suite, "latency_graphs"), "bs1", "median_itl_ms"),
        "itl_ms_bs1_eager": _dig(_step(suite, "latency_eager"), "bs1", "median_itl_ms"),
        "output_tok_s_random_1000x1000": _dig(_step(suite, "throughput_random"),
                                              "output_throughput"),
        # The same workload with an fp8 KV cache (bf16 weights) at the batch it allows.
        "output_tok_s_random_1000x1000_fp8_kv": _dig(_step(suite, "throughput_random_fp8"),
                                                     "output_throughput"),
        # And with an int8 KV cache (calibrated per-layer scales), at the same batch.
        "output_tok_s_random_1000x1000_int8_kv": _dig(_step(suite, "throughput_random_int8"),
                                                      "output_throughput"),
        # Not the configuration: fp8 W8A8 weights with an fp8 KV cache.
        "output_tok_s_random_1000x1000_w8a8_fp8_kv": _dig(
            _step(suite, "throughput_random_w8a8_fp8"), "output_throughput"),
        "ttft_ms_4096": _dig(_step(suite, "ttft_4096"), "median_ttft_ms"),
        "output_tok_s_128x512x128": _dig(_step(suite, "concurrent_128"), "output_throughput"),
        "hf_output_tok_s_128x512x128": _dig(_step(suite, "hf_baseline_128"), "output_tok_s"),
    }


def gap(value: float | None, goal: float, direction: Direction) -> dict[str, Any]:
    """How far `value` is from `goal`: `gap` > 0 means short of it, in the metric's unit."""
    if value is None:
        return {"value": None, "goal": goal, "direction": direction, "gap": None,
                "ratio_to_goal": None, "met": False}
    short = value - goal if direction == "lower" else goal - value
    return {"value": value, "goal": goal, "direction": direction, "gap": short,
            "ratio_to_goal": value / goal, "met": short <= 0}


def summarize(out_dir: Path, model: str, commit: str | None = None,
              dirty: bool | None = None) -> dict[str, Any]:
    """The summary of `out_dir`'s suite. `commit` (and `dirty`) name the suite's code when the
    summary is written elsewhere (tools/gpu/merge_suite.py); by default, this tree's."""
    suite_path = out_dir / "suite.json"
    suite = json.loads(suite_path.read_text()) if suite_path.exists() else {}
    kernels_path = out_dir / "kernels.json"
    values = headline(suite)
    if commit is None:
        info = git_info()
        commit, dirty = info["commit"], info["dirty"]
    return {
        "commit": commit,
        "dirty": dirty,
        "model": model,
        **values,
        "goals": {name: {"goal": g, "direction": d, "source": src}
                  for name, (g, d, src) in GOALS.items()},
        "gaps": {name: gap(values[name], g, d) for name, (g, d, _) in GOALS.items()},
        "engine_vs_hf_128x512x128": _ratio(values["output_tok_s_128x512x128"],
                                           values["hf_output_tok_s_128x512x128"]),
        "kernels_check_present": kernels_path.exists(),
        "failed_steps": {n: e.get("error") for n, e in suite.get("steps", {}).items()
                         if not e.get("ok")},
        "environment": suite.get("environment"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", default="llama-3.1-8b")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    doc = summarize(out_dir, args.model)
    path = write_json(out_dir / f"h200_{args.model}.json", doc)
    for name in GOALS:
        g = doc["gaps"][name]
        print(f"{name:<32}{g['value']!s:<24}goal {g['goal']:<10g}{'met' if g['met'] else 'NOT met'}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
