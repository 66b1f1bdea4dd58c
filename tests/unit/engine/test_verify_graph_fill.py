"""Which verify steps replay a verify graph (engine/runner/step_inputs.py
`uniform_verify_rows`): the graph computes every sequence's padded rows, so a step whose own
rows fill too little of them runs its rows alone; and the step cost counts the rows a graph
computed (engine/llm_engine.py `_decode_rows`)."""

from __future__ import annotations

from typing import cast

import pytest

from engine.llm_engine import _decode_rows
from engine.request import Request
from engine.runner.step_inputs import uniform_verify_rows, verify_graph_min_fill
from engine.scheduler import ScheduledRequest, SchedulerOutput


def _step(drafts: list[int]) -> SchedulerOutput:
    scheduled = [ScheduledRequest(cast(Request, None), 1 + d, 100, [], True, tuple(range(d)))
                 for d in drafts]
    return SchedulerOutput(scheduled, sum(1 + d for d in drafts))


def test_a_verify_graph_is_replayed_only_where_the_rows_fill_it() -> None:
    one_drafts = _step([4, 0, 0, 0])   # 8 rows of 20
    all_draft = _step([4, 4, 4, 3])    # 19 of 20
    assert uniform_verify_rows(one_drafts, 5, None, 4096) == 5       # fill 0: any verify step
    assert uniform_verify_rows(one_drafts, 5, None, 4096, 0.5) == 0
    assert uniform_verify_rows(one_drafts, 5, None, 4096, 0.4) == 5
    assert uniform_verify_rows(all_draft, 5, None, 4096, 0.9) == 5
    assert uniform_verify_rows(all_draft, 5, None, 4096, 1.0) == 0
    assert uniform_verify_rows(_step([0, 0]), 5, None, 4096) == 0     # no drafts: a plain step


def test_the_step_cost_counts_a_verify_graphs_padded_rows() -> None:
    step = _step([4, 0, 0, 0])
    assert _decode_rows(step) == 8
    step.padded_rows = 20   # as the runner sets it when the step replays the graph
    assert _decode_rows(step) == 20


def test_the_fill_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_VERIFY_GRAPH_MIN_FILL", "0.6")
    assert verify_graph_min_fill() == 0.6
    for bad in ("1.5", "-0.1", "half"):
        monkeypatch.setenv("SPLITSERVE_VERIFY_GRAPH_MIN_FILL", bad)
        with pytest.raises(ValueError, match="SPLITSERVE_VERIFY_GRAPH_MIN_FILL"):
            verify_graph_min_fill()
