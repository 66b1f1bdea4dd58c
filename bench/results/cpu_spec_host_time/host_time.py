"""Host time of speculation's bookkeeping per decode step on the CPU, with the worker's step
budget and pause floors (the policy's mode in the GPU probe) and without (always-on): the
drafting call (`LLMEngine._propose`: the budget's caps and floors, the proposers, shadow
drafts) and the step cost model's update (`StepCostModel.record`, its context refit every 16
steps included). Dummy tiny model, 64 sequences of 256 prompt tokens, `--output-len` tokens
each, 4 drafts of the forced chain right 60% of the time; each mode `--runs` times in turn.
Prints ms per step of each part per run, the median per mode as JSON, and with `--profile`
the drafting call's largest costs per mode (cProfile, cumulative).

    PYTHONPATH=. python3 bench/results/cpu_spec_host_time/host_time.py [--output-len 192]
    (bench/results/h100/spec_policy_1205/budget_host_time_10f1a34.txt: --output-len 64 --runs 2
    --profile, the drafting call alone, with the script then at that commit)
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine import LLM
from engine.llm_engine import LLMEngine
from engine.spec.cost import StepCostModel
from tools.probes import probe_spec_policy_gpu as probe
from tools.probes.forced_acceptance import ChainDrafter, make_chain_model


def _timed(cls: Any, name: str, totals: dict[str, float],
           profile: Callable[[], cProfile.Profile | None] = lambda: None) -> None:
    """Wrap `cls.name` so that its seconds add up in `totals[name]` (and, where `profile()`
    gives one, its calls are profiled)."""
    inner: Callable[..., Any] = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        prof = profile()
        started = time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            return inner(*args, **kwargs)
        finally:
            if prof is not None:
                prof.disable()
            totals[name] += time.perf_counter() - started

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    llm = LLM(model="dummy:tiny", dtype="bfloat16", device="cpu", seed=1, max_model_len=1024,
              max_num_batched_tokens=2048, max_num_seqs=64, cpu_threads=1,
              async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "calibration_max_batch": 4})
    engine = llm.engine
    chain = make_chain_model(engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(chain.vocab) for _ in range(256)] for _ in range(64)]
    drafter = ChainDrafter(chain, 0.6)
    totals = {"_propose": 0.0, "record": 0.0}
    profiles = {"always": cProfile.Profile(), "budget": cProfile.Profile()}
    current = {"mode": "always"}
    _timed(LLMEngine, "_propose", totals,
           lambda: profiles[current["mode"]] if args.profile else None)
    _timed(StepCostModel, "record", totals)
    per_mode: dict[str, list[dict[str, float]]] = {"always": [], "budget": []}
    for _ in range(args.runs):
        for budget in (False, True):
            mode = current["mode"] = "budget" if budget else "always"
            for key in totals:
                totals[key] = 0.0
            steps = engine.num_steps
            with probe.spec_settings(engine, drafter, budget=budget,
                                     min_accepted=None if budget else 0.0):
                run = probe.run_batch(engine, chain, prompts, args.output_len, 4, "forced_60",
                                      mode[:2])
            n = engine.num_steps - steps
            ms = {"drafting_ms": totals["_propose"] / n * 1e3,
                  "cost_model_ms": totals["record"] / n * 1e3}
            per_mode[mode].append(ms)
            print(f"{mode}: {n} steps, drafting call {ms['drafting_ms']:.3f} ms a step, cost "
                  f"model {ms['cost_model_ms']:.3f} ms a step, {run['draft_tokens']} drafts",
                  flush=True)
    print(json.dumps({mode: {key: round(statistics.median(r[key] for r in runs), 3)
                             for key in ("drafting_ms", "cost_model_ms")}
                      for mode, runs in per_mode.items()}))
    if args.profile:
        for mode, prof in profiles.items():
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(14)
            print("with the budget" if mode == "budget" else "always-on", out.getvalue())


if __name__ == "__main__":
    main()
