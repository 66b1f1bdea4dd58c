"""Shadow drafts (engine/spec/shadow.py): requests that do not verify a cheap proposer's drafts
(held at none by the step budget, sent without drafts, or speculating with another method) are
still asked for them, on a bounded sample; the drafts are scored against the tokens the request
goes on to produce and counted in the acceptance statistics (not in the verified-draft
counters); the tokens stay plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import SamplingParams
from engine.request import Request, RequestStatus
from engine.spec.budget import StepBudget
from engine.spec.ngram import NgramProposer
from engine.spec.shadow import ShadowDrafts, matched_prefix
from engine.spec.stats import AcceptanceStats
from engine.spec.suffix import SuffixProposer
from engine_api.request_options import RequestOptions
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
                batch: int, request_k: int, kv_tokens: float = 0.0) -> int:
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


def test_requests_sent_without_drafts_are_measured_too(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:  # noqa: F811
    """The gateway sent no drafts (num_speculative_tokens 0): nothing is verified, the steps
    are plain, and the worker's proposers are still measured on them."""
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config=NGRAM)
    engine = llm.engine
    engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))], wrong_from=1)
    outs, _ = _run(llm, _greedy(24, 17, 30, 9, 21), num_speculative_tokens=0)
    assert _tokens(outs) == plain
    assert engine.scheduler.num_draft_tokens == 0
    acc = engine.spec_stats.acceptance("ngram", "")
    assert acc is not None and acc.steps >= 10
    assert acc.accepted[0] == pytest.approx(acc.drafted[0]) and acc.accepted[1] == 0.0


def test_fixed_drafts_are_not_lowered_by_the_budget(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:  # noqa: F811
    """A request sent with fixed drafts (the gateway's "always") verifies its cap every step
    where the budget holds every other request at none."""
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={**NGRAM, "step_budget": True})
    engine = llm.engine
    engine.spec_budget = _HoldAll(engine.spec_cost, engine.spec_stats, 4)
    engine.proposer = _ScriptedProposer(
        PROMPTS, [plain[f"r{i}"] for i in range(len(PROMPTS))])
    params = [RequestOptions(sp, speculative_fixed=i % 2 == 0)
              for i, sp in enumerate(_greedy(24, 17, 30, 9, 21))]
    outs, _ = _run(llm, params)
    assert _tokens(outs) == plain
    # Only the fixed ones verified: all their drafts right, 5 tokens per step.
    assert engine.scheduler.num_draft_tokens > 0
    assert engine.scheduler.num_accepted_tokens == engine.scheduler.num_draft_tokens
    assert max(len(o.new_token_ids) for o in outs["r0"]) == 5
    assert max(len(o.new_token_ids) for o in outs["r1"]) == 1


class _LowerAfter(StepBudget):
    """A budget that lets the request's cap stand for its first rounds, then holds it at 2."""

    rounds = 0

    def cap_for(self, memo: dict[tuple[str, str], int], method: str, request_class: str,
                batch: int, request_k: int, kv_tokens: float = 0.0) -> int:
        self.rounds += 1
        return request_k if self.rounds <= 2 else min(2, request_k)


def test_positions_a_lowered_cap_left_out_keep_their_numbers(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:  # noqa: F811
    """Drafts that are always right, verified at 4 a step, then at 2 (the budget lowered the
    cap): the 3rd and 4th positions still read as drafted and accepted every time they were
    allowed, not as a proposer that stopped finding them (stats.py)."""
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={**NGRAM, "step_budget": True})
    engine = llm.engine
    engine.spec_budget = _LowerAfter(engine.spec_cost, engine.spec_stats, 4)
    engine.proposer = _ScriptedProposer([PROMPTS[0]], [plain["r0"]])
    outs, _ = _run(llm, _greedy(24), [PROMPTS[0]])
    assert _tokens(outs) == {"r0": plain["r0"]}
    sizes = [len(o.new_token_ids) for o in outs["r0"]]
    assert 5 in sizes and sizes.count(3) >= 3  # both caps verified (the premise)
    acc = engine.spec_stats.acceptance("ngram", "")
    assert acc is not None
    # Every step that allowed a 4th draft accepted it (the old count: 2 of ~7 steps).
    assert acc.accepted[3] == pytest.approx(acc.steps)
    assert acc.tokens_and_rows(4)[0] > acc.tokens_and_rows(2)[0] + 1.5


def _req(rid: str, prompt: list[int], method: str = "suffix", cap: int = 0) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=8))
    req.status = RequestStatus.RUNNING
    req.spec_method, req.spec_class = method, "text"
    req.num_speculative_tokens, req.spec_shadow_k = cap, 4
    return req


def test_a_proposal_whose_tail_never_came_is_dropped() -> None:
    stats = AcceptanceStats(4)
    shadow = ShadowDrafts(stats)
    proposers = {"ngram": NgramProposer(1, 3)}
    req = _req("a", [1, 2, 3, 1, 2])
    shadow.propose([req], proposers)  # drafts 3, 1, 2, 3 (the loop goes on)
    assert len(shadow) == 1
    shadow.propose([req], proposers)
    assert len(shadow) == 1  # one pending per method at a time
    req.append_output_token(3)
    shadow.score(req)
    assert len(shadow) == 1 and stats.acceptance("ngram", "text") is None  # 3 tokens to come
    shadow.release("a")
    assert len(shadow) == 0 and stats.acceptance("ngram", "text") is None
    shadow.propose([_req("b", [1, 2, 3])], proposers)  # no drafts found: a step with none
    acc = stats.acceptance("ngram", "text")
    assert acc is not None and acc.steps == 1.0 and sum(acc.drafted) == 0.0


def test_proposals_per_step_are_bounded_and_take_turns() -> None:
    stats = AcceptanceStats(4)
    shadow = ShadowDrafts(stats, max_sampled=8, max_per_step=2)
    proposers = {"ngram": NgramProposer(1, 3)}
    reqs = [_req(f"r{i}", [1, 2, 3, 1, 2]) for i in range(5)]
    asked: list[int] = []
    for _ in range(3):
        shadow.propose(reqs, proposers)
        asked.append(len(shadow))
    assert asked == [2, 4, 5]  # two new proposals a step until all five have one pending
    assert shadow.num_sampled == 5


def test_sampling_is_bounded_and_skips_what_is_verified() -> None:
    stats = AcceptanceStats(4)
    shadow = ShadowDrafts(stats, max_sampled=2)
    proposers = {"ngram": NgramProposer(1, 3)}
    loop = [1, 2, 3, 1, 2]
    verifying = _req("v", loop, method="ngram", cap=4)  # its real steps measure n-gram
    shadow.propose([verifying], proposers)
    assert len(shadow) == 0 and shadow.num_sampled == 1
    verifying.spec_step_k = 0  # the budget holds it at none: shadowed after all
    shadow.propose([verifying], proposers)
    assert len(shadow) == 1
    ineligible = _req("i", loop)
    ineligible.spec_shadow_k = 0  # e.g. it asked for logprobs
    shadow.propose([ineligible, _req("x", loop), _req("y", loop)], proposers)
    assert shadow.num_sampled == 2 and len(shadow) == 2  # "y" found no free slot
    shadow.release("v")
    shadow.propose([_req("y", loop)], proposers)
    assert shadow.num_sampled == 2 and len(shadow) == 2


def test_suffix_shadows_wait_until_the_requests_text_is_indexed() -> None:
    """A long prompt enters suffix decoding's tree over several rounds; a shadow proposal made
    from part of it would count the method low, so none is made (or counted) until all of it
    is in; then the request's own loop drafts."""
    stats = AcceptanceStats(4)
    shadow = ShadowDrafts(stats)
    suffix = SuffixProposer(max_depth=8, max_index_tokens=16)
    req = _req("a", [*range(200, 240), 1, 2, 3, 1, 2], method="ngram", cap=4)
    req.spec_step_k = 0  # held at none: shadowed by suffix decoding (and n-gram lookup)
    for _ in range(2):  # 16 and 32 of its 45 tokens indexed
        shadow.propose([req], {"suffix": suffix})
        assert len(shadow) == 0 and stats.acceptance("suffix", "text") is None
    shadow.propose([req], {"suffix": suffix})  # all 45: its loop drafts 3 1 2 ...
    assert len(shadow) == 1
    for t in (3, 1, 2, 3):
        req.append_output_token(t)
    shadow.score(req)
    acc = stats.acceptance("suffix", "text")
    assert acc is not None and acc.steps == 1.0 and acc.accepted[0] > 0
