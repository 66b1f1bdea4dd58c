"""What the step-cost model is fed (engine/llm_engine.py `_record_step_cost`): with async
scheduling a call that leaves its step running waits for the one before, so its time is the
earlier step's; only pure decode steps count, on both sides, so a batch's prompts never reach
the decode buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.llm_engine import _decode_rows
from engine.scheduler import SchedulerOutput
from tests.support.engine_driver import greedy, tiny_llm
from tests.unit.engine.test_spec_decode import NGRAM, PROMPTS


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_only_pure_decode_steps_are_timed_and_by_the_step_waited_for(
        tiny_model_dirs: dict[str, Path], async_scheduling: bool) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    # Per step call: [its schedule output, rows recorded or None, its step left in flight].
    calls: list[list[Any]] = []
    schedule, record = engine.scheduler.schedule, engine.spec_cost.record

    def spy_schedule() -> SchedulerOutput:
        out = schedule()
        calls.append([out, None, False])
        return out

    def spy_record(rows: int, seconds: float, kv_tokens: float = 0.0, sequences: int = 0,
                   verify: bool = False) -> None:
        calls[-1][1] = (rows, kv_tokens, sequences, verify)
        record(rows, seconds, kv_tokens, sequences, verify)

    engine.scheduler.schedule = spy_schedule  # type: ignore[method-assign]
    engine.spec_cost.record = spy_record  # type: ignore[method-assign]

    def step() -> None:
        engine.step()
        calls[-1][2] = engine.has_step_in_flight

    # Two waves: the second's prompts arrive while the first decodes.
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, greedy(12))
    for _ in range(4):
        step()
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"b{i}", p * 3, greedy(12))
    while engine.has_unfinished_requests():
        step()
    recorded = [i for i, (_, rows, _) in enumerate(calls) if rows is not None]
    assert recorded, "no decode step was timed"
    mixed = [i for i, (out, _, _) in enumerate(calls) if _decode_rows(out) is None]
    assert mixed, "the run had no prompt steps: the test proves nothing"
    assert any(c[2] for c in calls) == async_scheduling
    for i in recorded:
        out, (rows, kv_tokens, sequences, verify), left_running = calls[i]
        assert _decode_rows(out) is not None  # the step launched here decodes only
        if i > 0 and calls[i - 1][2]:  # it waited for the one before: that one's rows count
            timed = calls[i - 1][0]
            assert left_running and _decode_rows(timed) == rows
        else:  # launched and finished here
            timed = out
            assert not left_running and _decode_rows(out) == rows
            # With async scheduling a plain step finished at once was held back for drafts: it
            # is not what a batch that nobody drafts in costs.
            assert verify or not async_scheduling
        # Its KV tokens: the timed step's sequences' contexts, this step's tokens included.
        assert sequences == len(timed.scheduled) and verify == timed.has_drafts
        assert kv_tokens == sum(s.num_computed_tokens + s.num_new_tokens for s in timed.scheduled)
    # Every call that waited for a pure decode step while launching one was timed, and every
    # one that launched and finished a pure decode step (with async scheduling: a verify step).
    assert recorded == [i for i, (out, _, left_running) in enumerate(calls)
                        if _decode_rows(out) is not None and (
                            (i > 0 and calls[i - 1][2] and left_running
                             and _decode_rows(calls[i - 1][0]) is not None)
                            or ((i == 0 or not calls[i - 1][2]) and not left_running
                                and (out.has_drafts or not async_scheduling)))]
    assert any(calls[i][1][3] for i in recorded), "no verify step was timed"


def test_the_load_report_prices_steps_at_the_running_batchs_context(
        tiny_model_dirs: dict[str, Path]) -> None:
    """The reported curve is the model's at the running batch's KV tokens plus one sequence of
    the recent mean context: the batch a request the gateway sends joins."""
    from worker.spec_report import spec_report

    engine = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM).engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy(24))
    for _ in range(24):  # until both plain and verify steps were timed
        engine.step()
        if engine.spec_cost.points() and engine.spec_cost.points(verify=True):
            break
    running = list(engine.scheduler.running)
    assert running and len(engine.spec_cost) > 0
    cost = engine.spec_cost
    cost.per_kv_token = 1e-4  # as fitted from steps of several contexts
    kv = sum(r.num_tokens for r in running) + cost.context_per_sequence
    assert min(map(len, PROMPTS)) < cost.context_per_sequence < max(map(len, PROMPTS)) + 24
    reported = spec_report(engine)["spec_step_cost"]
    for verify in (False, True):
        points = cost.points(verify=verify)
        assert points, "no step of this kind was timed"
        assert [p.rows for p in reported if p.verify == verify] == [r for r, _ in points]
        assert [p.seconds for p in reported if p.verify == verify] == pytest.approx(
            [s + 1e-4 * kv for _, s in points])


def test_suffix_indexing_between_steps_is_not_taken_off_the_next_step(
        tiny_model_dirs: dict[str, Path]) -> None:
    """A request's first drafts can be proposed between steps (a decode worker's KV load
    finishing): the suffix tree's catch-up then is no part of the next step, whose time the
    engine lowers only by the catch-up done within it. Here 10 s of it before a step: taken off
    that step, its time would be negative and the step not recorded."""
    from engine.spec.suffix import SuffixProposer

    engine = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM,
                      async_scheduling=False).engine
    suffix = next(p for p in engine.proposers.values() if isinstance(p, SuffixProposer))
    recorded: list[float] = []
    record = engine.spec_cost.record

    def spy(rows: int, seconds: float, *args: Any, **kwargs: Any) -> None:
        recorded.append(seconds)
        record(rows, seconds, *args, **kwargs)

    engine.spec_cost.record = spy  # type: ignore[method-assign]
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, greedy(16))
    while not recorded:  # until decode steps are timed
        engine.step()
    before = len(recorded)
    suffix._index_seconds += 10.0  # as if indexed between steps
    engine.step()
    assert len(recorded) == before + 1 and 0 < recorded[-1] < 10.0

