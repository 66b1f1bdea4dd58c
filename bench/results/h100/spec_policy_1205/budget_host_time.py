"""Host time of the engine's drafting call (`LLMEngine._propose`) per step, with the worker's
step budget and pause floors (the policy's mode in the GPU probe) and without (always-on), on
the CPU: dummy tiny model, 64 sequences of 256 prompt tokens, 64 output tokens, 4 drafts of
the forced chain right 60% of the time, each mode twice in turn. Prints ms per step in the
call for each run, then the call's largest costs (cProfile, cumulative) per mode.

    PYTHONPATH=. python3 bench/results/h100/spec_policy_1205/budget_host_time.py
"""

import cProfile
import io
import pstats
import random
import time
from typing import Any

from engine import LLM
from engine.llm_engine import LLMEngine
from tools.probes import probe_spec_policy_gpu as probe
from tools.probes.forced_acceptance import ChainDrafter, make_chain_model


def main() -> None:
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
    propose = LLMEngine._propose
    profiles = {False: cProfile.Profile(), True: cProfile.Profile()}
    mode = {"budget": False, "seconds": 0.0}

    def timed(self: LLMEngine, reqs: Any) -> None:
        profile = profiles[bool(mode["budget"])]
        started = time.perf_counter()
        profile.enable()
        propose(self, reqs)
        profile.disable()
        mode["seconds"] = float(mode["seconds"]) + time.perf_counter() - started

    LLMEngine._propose = timed  # type: ignore[method-assign]
    for budget in (False, True, False, True):
        mode.update(budget=budget, seconds=0.0)
        steps = engine.num_steps
        with probe.spec_settings(engine, drafter, budget=budget,
                                 min_accepted=None if budget else 0.0):
            run = probe.run_batch(engine, chain, prompts, 64, 4, "forced_60",
                                  "po" if budget else "al")
        n = engine.num_steps - steps
        print(f"{'budget' if budget else 'always'}: {n} steps, drafting call "
              f"{float(mode['seconds']) / n * 1e3:.2f} ms a step, {run['draft_tokens']} drafts")
    for budget, profile in profiles.items():
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(14)
        print("with the budget" if budget else "always-on", out.getvalue())


if __name__ == "__main__":
    main()
