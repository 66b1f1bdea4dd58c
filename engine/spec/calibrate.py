"""Start-up measurement of a decode worker's step cost (cost.py): synthetic requests decoded
in batches of 1, 2, 4, ... up to `calibration_max_batch` sequences, each batch once plain and
once verifying the engine's cap of drafts per sequence, a few steps each after a few that are
not recorded (warm-up). A serving worker
runs it point by point while it is idle, after it is ready (`calibrate_when_idle`); an
in-process engine may run it at once (`calibrate_step_cost`). Bounded by
CALIBRATION_BUDGET_S; live steps refine the numbers afterwards.

The drafts are scripted (their acceptance does not change a step's rows), and nothing of the
run stays in the acceptance numbers or the speculation counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from engine.config import EngineConfig, ModelConfig
from engine.spec import Proposer, SequenceProposer
from engine.spec.budget import StepBudget
from engine.spec.cost import StepCostModel
from engine.spec.stats import AcceptanceStats, DraftRounds
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CALIBRATION_CLASS = "_calibration"
CALIBRATION_BUDGET_S = 15.0
CALIBRATION_STEPS = 3          # decode steps per (batch, drafts) point
# Decode steps of each point run before those, not recorded: the first carries the wait for
# the prompt step (an async engine's step returns when the previous one is done) and any first
# use of the point's shape (kernel loading, tuning), and a bucket's first step sets its average
# (cost.py). Recorded, it made rows 1 and rows 5 cost 17-18 ms against ~4 on the H200 (dummy 8B,
# c86461f).
CALIBRATION_WARMUP_STEPS = 2
IDLE_RETRY_S = 0.5             # a busy serving engine is asked again after this long
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
    spec_rounds: DraftRounds
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


def calibration_points(engine: CalibratedEngine) -> list[tuple[int, int]]:
    """(batch, drafts per sequence) to measure: batches 1, 2, 4, ... up to the configured
    size, each plain and with the engine's cap of drafts (none without speculation)."""
    spec = engine.config.speculative
    max_batch = min(spec.calibration_max_batch, engine.config.scheduler.max_num_seqs)
    if not engine.proposers or max_batch <= 0:
        return []
    points = []
    batch = 1
    while batch <= max_batch:
        points += [(batch, 0), (batch, spec.num_speculative_tokens)]
        batch *= 2
    return points


def calibrate_point(engine: CalibratedEngine, batch: int, drafts: int) -> int:
    """Measure one point now if the engine is idle (no request, no step in flight: the
    synthetic requests must not share steps with real ones); returns the steps run (0: busy,
    nothing done). Leaves no trace but the step cost."""
    if engine.scheduler.requests or engine.has_step_in_flight:
        return 0
    spec = engine.config.speculative
    method, k = spec.method, spec.num_speculative_tokens
    vocab = engine.model_config.vocab_size
    sched, stats, live_cost = engine.scheduler, engine.spec_stats, engine.spec_cost
    saved = (engine.config, engine.proposers[method], engine.spec_budget, live_cost,
             engine.spec_rounds, sched.num_draft_tokens, sched.num_accepted_tokens,
             stats.num_drafts, list(stats.accepted_per_pos))
    engine.spec_rounds = DraftRounds()  # the synthetic requests' rounds: not counted
    # Drafts every step: no pause for failing drafts, no budget lowering them.
    engine.config = dataclasses.replace(
        engine.config, speculative=dataclasses.replace(spec, min_accepted_per_step=0.0))
    engine.proposers[method] = _ScriptedDrafts()
    engine.spec_budget = None
    # Room for every draft of every step (the scheduler cuts drafts at max_tokens); the
    # requests are aborted after the measured decode steps.
    decode_steps = CALIBRATION_WARMUP_STEPS + CALIBRATION_STEPS
    params = SamplingParams(temperature=0.0, max_tokens=(k + 1) * (decode_steps + 2),
                            ignore_eos=True)
    steps = 0
    try:
        ids = [f"_calibration-{batch}-{drafts}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            prompt = [(7 * i + j + 1) % vocab for j in range(_PROMPT_TOKENS)]
            engine.add_request(rid, prompt, RequestOptions(
                params, num_speculative_tokens=drafts, speculative_method=method,
                speculative_class=CALIBRATION_CLASS))
        engine.spec_cost = StepCostModel()  # the prompts and the warm-up: not recorded
        for _ in range(1 + CALIBRATION_WARMUP_STEPS):
            engine.step()
            steps += 1
        engine.spec_cost = live_cost
        live_cost.fit_context = False  # short contexts on an idle host: points, not the slope
        for _ in range(CALIBRATION_STEPS):
            engine.step()
            steps += 1
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_step_in_flight:
            engine.step()
    finally:
        live_cost.fit_context = True
        (engine.config, engine.proposers[method], engine.spec_budget, engine.spec_cost,
         engine.spec_rounds, sched.num_draft_tokens, sched.num_accepted_tokens,
         stats.num_drafts, stats.accepted_per_pos) = saved
        stats.forget(CALIBRATION_CLASS)
    return steps


def _log_points(engine: CalibratedEngine, steps: int) -> None:
    cost = engine.spec_cost
    logger.info("speculation: step cost measured in %d steps: plain %s; verify %s", steps,
                ", ".join(f"{r:.0f} rows {s * 1e3:.2f} ms" for r, s in cost.points()),
                ", ".join(f"{r:.0f} rows {s * 1e3:.2f} ms" for r, s in cost.points(verify=True)))


def calibrate_step_cost(engine: CalibratedEngine, budget_s: float = CALIBRATION_BUDGET_S) -> int:
    """Measure the step cost of batches up to the configured size now (the engine idle);
    returns the steps run."""
    deadline = time.monotonic() + budget_s
    steps = 0
    for batch, drafts in calibration_points(engine):
        if time.monotonic() >= deadline:
            break
        steps += calibrate_point(engine, batch, drafts)
    if steps:
        _log_points(engine, steps)
    return steps


class _EngineCalls(Protocol):
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


async def calibrate_when_idle(aengine: _EngineCalls, engine: CalibratedEngine,
                              budget_s: float = CALIBRATION_BUDGET_S) -> int:
    """A serving worker's calibration: one point at a time on the engine thread, each only
    while no request is there (a request that arrives meanwhile waits at most one point), so
    the worker is ready at once. Until the points exist the gateway's policy falls back to its
    load threshold and live steps fill the model too. `budget_s`: engine time spent on it at
    most. Returns the steps run; ends quietly when the engine stops."""
    spent = 0.0
    steps = 0
    try:
        for batch, drafts in calibration_points(engine):
            while True:
                if spent >= budget_s:
                    return steps
                started = time.monotonic()
                done = await aengine.call(calibrate_point, engine, batch, drafts)
                spent += time.monotonic() - started
                if done:
                    steps += done
                    break
                await asyncio.sleep(IDLE_RETRY_S)
    except Exception as e:  # the engine stopped (or died: its own error reports that)
        logger.info("speculation: calibration stopped after %d steps: %r", steps, e)
        return steps
    if steps:
        _log_points(engine, steps)
    return steps
