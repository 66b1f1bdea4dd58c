"""Start-up measurement of a decode worker's step cost (cost.py): synthetic requests decoded
in batches of 1, 2, 4, ... up to `calibration_max_batch` sequences, each batch once plain and
once verifying the engine's cap of drafts per sequence, a few steps each, before the worker
takes requests. Bounded by CALIBRATION_BUDGET_S; live steps refine the numbers afterwards.

The drafts are scripted (their acceptance does not change a step's rows), and nothing of the
run stays in the acceptance numbers or the speculation counters.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from engine.config import EngineConfig, ModelConfig
from engine.spec import Proposer, SequenceProposer
from engine.spec.budget import StepBudget
from engine.spec.cost import StepCostModel
from engine.spec.stats import AcceptanceStats
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CALIBRATION_CLASS = "_calibration"
CALIBRATION_BUDGET_S = 15.0
CALIBRATION_STEPS = 3          # decode steps per (batch, drafts) point
_PROMPT_TOKENS = 8


class _Scheduler(Protocol):
    @property
    def requests(self) -> Mapping[str, object]: ...

    num_draft_tokens: int
    num_accepted_tokens: int


class CalibratedEngine(Protocol):
    """What calibration uses of `LLMEngine` (which calls it: no import back, no cycle)."""

    config: EngineConfig
    model_config: ModelConfig
    proposers: dict[str, Proposer]
    spec_cost: StepCostModel
    spec_stats: AcceptanceStats
    spec_budget: StepBudget | None

    @property
    def scheduler(self) -> _Scheduler: ...

    @property
    def has_step_in_flight(self) -> bool: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: RequestOptions) -> Any: ...

    def step(self) -> Any: ...

    def abort_request(self, request_id: str) -> bool: ...


class _ScriptedDrafts(SequenceProposer):
    """k copies of the last token: verified like any drafts, rarely accepted."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return [token_ids[-1]] * k


def calibrate_step_cost(engine: CalibratedEngine, budget_s: float = CALIBRATION_BUDGET_S) -> int:
    """Measure the step cost of batches up to the configured size; returns the steps run."""
    spec = engine.config.speculative
    max_batch = min(spec.calibration_max_batch, engine.config.scheduler.max_num_seqs)
    if not engine.proposers or max_batch <= 0:
        return 0
    method, k = spec.method, spec.num_speculative_tokens
    vocab = engine.model_config.vocab_size
    sched, stats = engine.scheduler, engine.spec_stats
    saved = (engine.config, engine.proposers[method], engine.spec_budget,
             sched.num_draft_tokens, sched.num_accepted_tokens, stats.num_drafts,
             list(stats.accepted_per_pos))
    # Drafts every step: no pause for failing drafts, no budget lowering them.
    engine.config = dataclasses.replace(
        engine.config, speculative=dataclasses.replace(spec, min_accepted_per_step=0.0))
    engine.proposers[method] = _ScriptedDrafts()
    engine.spec_budget = None
    # Room for every draft of every step (the scheduler cuts drafts at max_tokens); the
    # requests are aborted after CALIBRATION_STEPS decode steps.
    params = SamplingParams(temperature=0.0, max_tokens=(k + 1) * (CALIBRATION_STEPS + 2),
                            ignore_eos=True)
    deadline = time.monotonic() + budget_s
    steps = 0
    try:
        batch = 1
        while batch <= max_batch and time.monotonic() < deadline:
            for drafts in (0, k):
                ids = [f"_calibration-{batch}-{drafts}-{i}" for i in range(batch)]
                for i, rid in enumerate(ids):
                    prompt = [(7 * i + j + 1) % vocab for j in range(_PROMPT_TOKENS)]
                    engine.add_request(rid, prompt, RequestOptions(
                        params, num_speculative_tokens=drafts, speculative_method=method,
                        speculative_class=CALIBRATION_CLASS))
                for _ in range(1 + CALIBRATION_STEPS):  # the prompts, then decode steps
                    engine.step()
                    steps += 1
                for rid in ids:
                    engine.abort_request(rid)
                while engine.has_step_in_flight:
                    engine.step()
            batch *= 2
    finally:
        (engine.config, engine.proposers[method], engine.spec_budget, sched.num_draft_tokens,
         sched.num_accepted_tokens, stats.num_drafts, stats.accepted_per_pos) = saved
        stats.forget(CALIBRATION_CLASS)
    logger.info("speculation: step cost measured in %d steps: %s", steps,
                ", ".join(f"{r:.0f} rows {s * 1e3:.2f} ms" for r, s in engine.spec_cost.points()))
    return steps
