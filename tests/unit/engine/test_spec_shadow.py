"""Shadow drafts (engine/spec/shadow.py): a request the step budget holds at no drafts is still
asked for drafts, which are scored against the tokens it goes on to produce and counted in the
acceptance statistics (not in the verified-draft counters); its tokens stay plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.request import Request
from engine.spec.budget import StepBudget
from engine.spec.shadow import ShadowDrafts, matched_prefix
from engine.spec.stats import AcceptanceStats
from tests.support.engine_driver import tiny_llm
from tests.unit.engine.test_spec_decode import (
    NGRAM,
    PROMPTS,
    _greedy,
    _run,
    _ScriptedProposer,
    _tokens,
    plain,  # noqa: F401  (the module fixture: plain decoding's tokens)
)


class _HoldAll(StepBudget):
    """A budget that finds drafting never pays: every request of every class held at none."""

    def cap_for(self, memo: dict[tuple[str, str], int], method: str, request_class: str,
                batch: int, request_k: int) -> int:
        return 0


def test_matched_prefix_stops_at_the_first_wrong_draft() -> None:
    assert matched_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert matched_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert matched_prefix([1, 2], [1]) == 1
    assert matched_prefix([], [1]) == 0


@pytest.mark.parametrize(("wrong_from", "accepted_share"), [(None, 1.0), (2, 0.5), (0, 0.0)])
def test_held_requests_are_measured_by_their_shadow_drafts(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]],  # noqa: F811
        wrong_from: int | None, accepted_share: float) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={**NGRAM, "step_budget": True})
    engine = llm.engine
    engine.spec_budget = _HoldAll(engine.spec_cost, engine.spec_stats, 4)
    engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))], wrong_from=wrong_from)
    outs, steps = _run(llm, _greedy(24, 17, 30, 9, 21))
    assert _tokens(outs) == plain
    assert engine.scheduler.num_draft_tokens == 0  # nothing verified: all held
    assert steps >= 30  # one token per step
    acc = engine.spec_stats.acceptance("ngram", "")
    assert acc is not None and acc.steps >= 10
    # The scripted drafts are right up to `wrong_from`: 4 drafted per proposal (fewer at the
    # ends of the known outputs), and exactly the leading right ones counted as accepted.
    assert sum(acc.drafted) / acc.steps > 3.0
    assert sum(acc.accepted) / sum(acc.drafted) == pytest.approx(accepted_share, abs=0.08)
    if wrong_from == 2:
        assert acc.accepted[2] == 0.0 and acc.accepted[1] == pytest.approx(acc.accepted[0])
    # vLLM's counters count verified drafts only.
    assert engine.spec_stats.num_drafts == 0
    assert len(engine.spec_shadow) == 0  # every pending proposal scored or dropped at the end
    engine.scheduler.check_integrity()


def test_a_proposal_whose_tail_never_came_is_dropped() -> None:
    stats = AcceptanceStats(4)
    shadow = ShadowDrafts(stats)

    req = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    req.spec_method, req.spec_class = "suffix", "text"
    assert shadow.wants(req)
    shadow.add(req, [4, 5])
    assert not shadow.wants(req)  # one pending at a time
    req.append_output_token(4)
    shadow.score(req)
    assert len(shadow) == 1 and stats.acceptance("suffix", "text") is None
    shadow.release("a")
    assert len(shadow) == 0 and stats.acceptance("suffix", "text") is None
    shadow.add(req, [])  # no drafts found: a step with none
    acc = stats.acceptance("suffix", "text")
    assert acc is not None and acc.steps == 1.0 and sum(acc.drafted) == 0.0
