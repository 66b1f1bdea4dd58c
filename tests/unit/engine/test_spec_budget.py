"""The worker's per-step cap on drafts (engine/spec/budget.py) from its measured step cost and
acceptance: all drafts where they pay, none where they do not, the request's cap while
unmeasured, and exploration by one request of a class at a time where shadow drafts cannot
measure (a draft model)."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.request import Request
from engine.spec import SequenceProposer, propose_all, record_verify
from engine.spec.budget import EXPLORE_EVERY, MIN_MEASURED_STEPS, POSITION_EXPLORE_EVERY, StepBudget
from engine.spec.cost import StepCostModel
from engine.spec.stats import AcceptanceStats, DraftRounds


def _budget(accepted: int, method: str = "ngram") -> StepBudget:
    """Compute-bound steps (1 ms per row beyond a 16-row flat part); the class's drafts: 4
    per step, `accepted` of them accepted."""
    cost = StepCostModel()
    for rows, seconds in ((1, 0.016), (16, 0.016), (64, 0.064), (256, 0.256)):
        cost.record(rows, seconds)
    stats = AcceptanceStats(4)
    for _ in range(int(MIN_MEASURED_STEPS) + 4):
        stats.record(method, "text", 4, accepted)
    return StepBudget(cost, stats, 4)


def test_drafts_where_they_pay() -> None:
    good = _budget(accepted=4)
    assert good.cap_for({}, "ngram", "text", 1, 4) == 4
    assert good.cap_for({}, "ngram", "text", 1, 2) == 2  # never above the request's cap
    assert _budget(accepted=0).cap_for({}, "ngram", "text", 1, 4) == 0
    assert good.cap_for({}, "ngram", "unmeasured", 64, 3) == 3


def _rounds(budget: StepBudget, method: str) -> list[list[int]]:
    caps = []
    for _ in range(EXPLORE_EVERY):
        memo: dict[tuple[str, str], int] = {}  # one round: a batch of 8 of the class
        caps.append([budget.cap_for(memo, method, "text", 8, 4) for _ in range(8)])
    return caps


def test_a_draft_model_explores_with_one_request_per_round() -> None:
    explored = [c for c in _rounds(_budget(0, "draft_model"), "draft_model") if any(c)]
    assert explored == [[4, 0, 0, 0, 0, 0, 0, 0]]


def test_cheap_proposers_do_not_explore() -> None:
    """N-gram lookup and suffix decoding are measured by shadow drafts (shadow.py) instead."""
    for method in ("ngram", "suffix"):
        assert not any(any(c) for c in _rounds(_budget(0, method), method))


def test_positions_above_a_lowered_cap_are_explored() -> None:
    """A class whose steps were only ever allowed 1 draft (its 2nd-4th positions never
    measured: they read as no drafts, so k = 4 looks like k = 1): every
    POSITION_EXPLORE_EVERY-th round one of its requests drafts its full cap, shadowed method
    or not (shadow drafts skip the method a request verifies), so the cap can rise again."""
    for method in ("suffix", "ngram"):
        budget = _budget(accepted=4, method=method)
        stats = AcceptanceStats(4)
        for _ in range(int(MIN_MEASURED_STEPS) + 4):
            stats.record(method, "text", 1, 1, allowed=1)
        budget.stats = stats
        caps = []
        for _ in range(2 * POSITION_EXPLORE_EVERY):
            memo: dict[tuple[str, str], int] = {}
            caps.append([budget.cap_for(memo, method, "text", 8, 4) for _ in range(4)])
        explored = [4, 1, 1, 1]
        assert caps == ([[1] * 4] * (POSITION_EXPLORE_EVERY - 1) + [explored]) * 2
        # Once the explored steps show the higher positions right, the cap rises.
        for _ in range(8):
            stats.record(method, "text", 4, 4, allowed=4)
        assert budget.cap_for({}, method, "text", 2, 4) == 4  # 10 rows: still flat


def _measured(plain: list[tuple[int, float]], verify: list[tuple[int, float]]) -> StepBudget:
    cost = StepCostModel()
    for rows, seconds in plain:
        cost.record(rows, seconds)
    for rows, seconds in verify:
        cost.record(rows, seconds, verify=True)
    return StepBudget(cost, AcceptanceStats(4), 4)


def test_the_pause_floor_is_what_one_requests_drafts_cost_its_batch() -> None:
    """Weights-bound verify steps (the H100's small batches: 6.4 ms at 5 rows, 8.1 at 80): a
    request's 4 drafts add little to a batch of 16, so it keeps drafting at 0.3 accepted a step
    (30% acceptance gives 0.43); alone it pays from verify / plain - 1. Compute-bound (the CPU:
    3 ms a verify row) it must accept more than one draft a step. Unmeasured: None (the configured
    floor)."""
    gpu = _measured([(1, 0.00537), (16, 0.0064)], [(5, 0.00642), (80, 0.0081)])
    x = 4 * (0.0081 - 0.00642) / 75 * 16 / 0.0081
    assert gpu.pause_floor(16, 4) == pytest.approx(x / (1 - x)) and x / (1 - x) < 0.25
    alone = gpu.pause_floor(1, 4)
    assert alone == pytest.approx((0.00642 - 0.00537) / 0.00537, rel=1e-6)
    cpu = _measured([(1, 0.057), (16, 0.16)], [(5, 0.099), (80, 0.33)])
    x = 4 * (0.33 - 0.099) / 75 * 16 / 0.33
    assert cpu.pause_floor(16, 4) == pytest.approx(x / (1 - x))
    assert 1.0 < x / (1 - x) < 1.6
    assert _measured([(1, 0.057)], []).pause_floor(16, 4) is None
    assert gpu.pause_floor(16, 0) is None


def test_drafts_a_verify_graph_pads_cost_nothing_to_pause_for() -> None:
    """Where the verify graph computes 1 + 4 rows for every sequence of the batch, a request
    that stops drafting saves its batch nothing: no floor, while another sequence verifies. A
    request alone turns its step into a plain one: its floor is as before."""
    plain, verify = [(1, 0.00537), (16, 0.0064)], [(5, 0.00642), (80, 0.0081)]
    padded = _measured(plain, verify)
    padded.cost.verify_pad = (5, 64)
    assert padded.pause_floor(16, 4) == 0.0 and padded.pause_floor(16, 2) == 0.0
    assert padded.pause_floor(1, 4) == pytest.approx(_measured(plain, verify).pause_floor(1, 4))
    assert padded.pause_floor(16, 4) != _measured(plain, verify).pause_floor(16, 4)
    padded.cost.verify_pad = (5, 8)  # 16 sequences: past the graph's, eager
    assert padded.pause_floor(16, 4) == pytest.approx(_measured(plain, verify).pause_floor(16, 4))


def _drafting_share(rate: float, floor: float, tokens: int = 1500, then: float | None = None,
                    half: int = 0, seed: int = 0) -> float:
    """One request through propose_all and record_verify as the engine runs them: each verify
    step accepts i + 1 of 4 drafts with probability rate^(i+1) (the GPU probe's forced chain),
    `then` from token `half` on. The share of its steps that verified (from `half` on)."""
    class _Four(SequenceProposer):
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            return [0] * k

    rng = random.Random(seed)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=tokens + 8, ignore_eos=True))
    req.num_speculative_tokens = 4
    steps = verified = 0
    while req.num_tokens < tokens:
        late = req.num_tokens >= half
        rate_now = then if then is not None and late else rate
        propose_all([req], _Four(), 0.4, lambda r: 4, lambda r: floor)
        steps += late
        accepted = 0
        if req.spec_token_ids:
            verified += late
            while accepted < 4 and rng.random() < rate_now:
                accepted += 1
            record_verify(req, 4, accepted)
        for _ in range(1 + accepted):
            req.append_output_token(0)
    return verified / steps


def test_a_request_near_its_floor_keeps_drafting_one_that_fails_pauses() -> None:
    """The H100's floor for one sequence (0.24) against 30% acceptance (0.43 drafts a step): the
    four-step average alone paused it most of the time (it verified in about a quarter of its
    steps; on the H100 it drafted 92 tokens to always-on's 349); with the long average it
    verifies in most. Drafts never right: paused nearly always. Right 60% of the time, then
    never: as good as never after; the other way round: drafting again, as good as always."""
    shares = [_drafting_share(0.3, 0.24, seed=s) for s in range(6)]
    assert min(shares) > 0.65 and sum(shares) / len(shares) > 0.8, shares
    assert _drafting_share(0.0, 0.24) < 0.08
    assert _drafting_share(0.0, 0.24, then=0.6, tokens=3000, half=1500) > 0.9
    assert _drafting_share(0.6, 0.24, then=0.0, tokens=3000, half=1500) < 0.1


def test_requests_pause_by_the_measured_floor_where_it_is_lower() -> None:
    """The measured floor lowers the configured one (0.4), never raises it: a pause is coarse,
    and on the CPU a floor of about one draft a step paused stories whose acceptance varied
    (0.90 of always drafting at 32 against 1.02)."""
    class _Some(SequenceProposer):
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            return [0] * k

    def paused(avg: float, floor: float | None, configured: float = 0.4) -> bool:
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100))
        req.num_speculative_tokens = 4
        req.spec_accepted_avg = req.spec_accepted_long_avg = avg
        propose_all([req], _Some(), configured, lambda r: 4, lambda r: floor)
        return not req.spec_token_ids

    assert paused(0.3, None) and not paused(0.3, 0.05)   # weights-bound: keeps drafting
    # Compute-bound: a measured floor above the configured one does not raise it.
    assert not paused(0.8, 1.1) and paused(0.3, 1.1)
    assert not paused(0.0, 0.05, configured=0.0)          # a floor of 0: pauses off


def test_the_workers_drafting_decisions_are_counted() -> None:
    """Each round counts the drafts the budget allowed each request (0: held at none) by
    method and class; a pause counts once when it begins, not in the rounds it lasts."""
    class _Some(SequenceProposer):
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            return [0] * k

    def request(rid: str, request_class: str) -> Request:
        req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=100))
        req.num_speculative_tokens, req.spec_method, req.spec_class = 4, "suffix", request_class
        return req

    rounds = DraftRounds()
    code, text, held = request("a", "code"), request("b", "text"), request("c", "text")
    caps = {"a": 4, "b": 2, "c": 0}
    for _ in range(2):
        propose_all([code, text, held], _Some(), 0.4, lambda r: caps[r.request_id], None,
                    rounds)
    assert rounds.allowed == {("suffix", "code", 4): 2, ("suffix", "text", 2): 2,
                              ("suffix", "text", 0): 2}
    assert rounds.pauses == {}
    code.spec_accepted_avg = code.spec_accepted_long_avg = 0.0  # its drafts keep failing
    propose_all([code], _Some(), 0.4, lambda r: 4, None, rounds)
    assert not code.spec_token_ids and rounds.pauses == {("suffix", "code"): 1}
    propose_all([code], _Some(), 0.4, lambda r: 4, None, rounds)  # still paused
    assert rounds.pauses == {("suffix", "code"): 1}
    assert rounds.allowed[("suffix", "code", 4)] == 2
