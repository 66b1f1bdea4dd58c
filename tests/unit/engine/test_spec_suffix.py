"""Suffix decoding (engine/spec/suffix.py), exactness of speculative decoding with it and with
n-gram lookup (greedy and seeded sampling, float32: the same tokens as plain decoding), and
the worker-side measurements the speculation policy reads: step cost (start-up calibration
and live steps), acceptance per method and class, and the per-step budget's numbers
(engine_api/spec_gain.py). The rejection sampler's distribution test is in
test_spec_decode.py (`test_random_verify_keeps_the_target_distribution`)."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import ConfigError, parse_speculative_config
from engine.request import Request
from engine.spec import SequenceProposer
from engine.spec.calibrate import CALIBRATION_STEPS, CALIBRATION_WARMUP_STEPS, calibrate_point
from engine.spec.cost import COST_WINDOW, StepCostModel, monotone
from engine.spec.stats import AcceptanceStats
from engine.spec.suffix import SuffixProposer, SuffixTree
from engine_api.spec_gain import Acceptance, StepCost, best_k
from tests.support.engine_driver import run_steps, step_tokens, tiny_llm

# Prompts with loops (drafts found) and without.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
    [(7 * j) % 250 + 1 for j in range(23)],
    [9, 9, 9, 9, 9, 9],
    [11, 12, 13, 14, 15, 11, 12, 13],
]
LENGTHS = (24, 17, 30, 21)
# No step budget: the drafts (and so the counts asserted) must not follow the shared
# machine's timing.
SPEC: dict[str, Any] = {"num_speculative_tokens": 4, "step_budget": False}


# ---- the suffix tree -----------------------------------------------------------------------

def test_suffix_tree_counts_windows_and_removes_them_again() -> None:
    tree = SuffixTree(max_depth=3)
    tree.add([1, 2, 3, 1, 2, 4])
    node, length = tree.match([9, 1, 2]) or (None, 0)
    assert length == 2 and node is not None
    assert {t: c.count for t, c in node.children.items()} == {3: 1, 4: 1}
    assert tree.root.children[1].count == 2
    before = tree.num_nodes
    tree.add([7, 7])
    tree.remove([7, 7])
    assert tree.num_nodes == before
    tree.remove([1, 2, 3, 1, 2, 4])
    assert tree.num_nodes == 0 and not tree.root.children


def test_incremental_add_equals_one_add() -> None:
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1]
    whole, parts = SuffixTree(4), SuffixTree(4)
    whole.add(seq)
    active = parts.add(seq[:5])
    parts.add(seq[5:], active)
    assert whole.num_nodes == parts.num_nodes
    assert whole.speculate([1, 4], 8, 4.0, 0.0) == parts.speculate([1, 4], 8, 4.0, 0.0)


def test_speculation_follows_the_frequent_path_scaled_by_the_match() -> None:
    tree = SuffixTree(max_depth=8)
    tree.add([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5, 6])
    drafts, _ = tree.speculate([0, 2, 3], 8, max_spec_factor=1.0, min_token_prob=0.0)
    assert drafts == [4, 5]  # a 2-token match drafts at most 2
    drafts, _ = tree.speculate([1, 2, 3, 4, 5], 1, 4.0, 0.0)
    assert drafts == [6]     # 6 followed twice, 7 once; the cap is 1
    # 6 has probability 2/3 after 5: below a 0.7 floor nothing is drafted past the match.
    assert tree.speculate([4, 5], 4, 4.0, 0.7)[0] == []
    assert tree.speculate([42], 4, 4.0, 0.0)[0] == []


def _request(rid: str, prompt: list[int], output: list[int], k: int = 4) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=64), (), 4096)
    for t in output:
        req.append_output_token(t)
    req.num_speculative_tokens = k
    return req


def test_proposer_drafts_from_the_request_and_from_finished_outputs() -> None:
    p = SuffixProposer(max_depth=8, max_cached_requests=1)
    own = _request("a", [1, 2, 3, 4, 1, 2], [])
    assert p.propose(own) == [3, 4]  # its own loop (a 2-token match: 2 drafts)
    done = _request("b", [50], [20, 21, 22, 23, 24, 25])
    assert p.propose(done) == []
    p.release("b")  # its output joins the shared tree
    other = _request("c", [60, 61, 20, 21, 22], [])
    assert p.propose(other) == [23, 24, 25]
    # One cached request at most: the next finished output evicts the first entirely.
    p.release("c")  # no output: nothing cached
    assert p.propose(_request("d", [21, 22], [])) == [23, 24]
    p.propose(_request("e", [70], [90, 91]))
    p.release("e")
    assert p.propose(_request("f", [21, 22], [])) == []
    assert p.shared.num_nodes == 3  # 90, 91, and 90 91
    for rid in "adf":
        p.release(rid)
    assert len(p._tracked) == 0


def _tree_of(tokens: list[int], depth: int = 8) -> SuffixTree:
    tree = SuffixTree(depth)
    tree.add(tokens)
    return tree


def _windows(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every string the tree counts, with its count (two trees equal as counted windows)."""
    out: dict[tuple[int, ...], int] = {}
    todo: list[tuple[tuple[int, ...], Any]] = [((), tree.root)]
    while todo:
        path, node = todo.pop()
        for t, child in node.children.items():
            out[(*path, t)] = child.count
            todo.append(((*path, t), child))
    return out


def test_a_long_prompt_is_indexed_a_budget_a_call_and_drafts_meanwhile() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7] * 5 + [1, 2, 3]  # 38 tokens
    p = SuffixProposer(max_depth=8, max_index_tokens=10)
    req = _request("a", prompt, [])
    # The first call indexes 10 tokens: the loop is already in them, so it drafts (from the
    # 3-token match 1 2 3: 3 drafts).
    assert p.propose(req) == [4, 5, 6]
    assert len(p._tracked["a"].tokens) == 10
    for calls in range(2, 5):
        p.propose(req)
        assert len(p._tracked["a"].tokens) == min(10 * calls, len(prompt))
    assert _windows(p._tracked["a"].tree) == _windows(_tree_of(prompt))


def test_caught_up_requests_index_their_new_tokens_before_a_long_prompt() -> None:
    p = SuffixProposer(max_depth=8, max_index_tokens=6)
    running = _request("run", [8, 9, 10], [])
    p.propose(running)
    for t in (11, 12):
        running.append_output_token(t)
    newcomer = _request("new", list(range(100, 140)), [])
    p.propose_batch([newcomer, running])  # the newcomer listed first
    assert p._tracked["run"].tokens == [8, 9, 10, 11, 12]
    assert len(p._tracked["new"].tokens) == 4  # what the budget left


def test_outputs_evicted_before_they_were_indexed_never_enter_the_shared_tree() -> None:
    """Requests can finish faster than a call's budget indexes their outputs: the backlog
    stays within the cache (the oldest pending outputs dropped as they are evicted; of one
    half indexed, the half leaves again) instead of growing with every request served."""
    def finish(p: SuffixProposer, rid: str, output: list[int]) -> None:
        req = _request(rid, [1], output)
        p._track(req)  # known to the proposer, as a request it drafted for (nothing indexed)
        p.release(rid)

    p = SuffixProposer(max_depth=4, max_cached_requests=2, max_index_tokens=5)
    outputs = [[10 * i + j for j in range(6)] for i in range(1, 11)]
    for i, out in enumerate(outputs):
        finish(p, f"r{i}", out)
    assert p.backlog == 12  # the last two outputs' adds (old: 10 adds and 8 removals, 108)
    while p.backlog:
        p.propose(_request("x", [99], []))
    expected = SuffixTree(4)
    for out in outputs[-2:]:
        expected.add(out)
    assert _windows(p.shared) == _windows(expected)

    p = SuffixProposer(max_depth=4, max_cached_requests=1, max_index_tokens=5)
    finish(p, "a", list(range(20, 32)))
    p.propose(_request("x", [99], []))  # 4 of a's 12 tokens in the tree
    finish(p, "b", [40, 41, 42])  # a evicted half indexed, b before any of it
    finish(p, "c", [50, 51, 52])
    assert p.backlog == 4 + 3  # a's 4 leave, c's 3 enter
    while p.backlog:
        p.propose(_request("x", [99], []))
    assert _windows(p.shared) == _windows(_tree_of([50, 51, 52], 4))


def test_requests_behind_catch_up_nearest_first_and_say_when_they_have() -> None:
    p = SuffixProposer(max_depth=8, max_index_tokens=10)
    far, near = _request("far", list(range(100, 140)), []), _request("near", [1, 2] * 6, [])
    # The nearer first, whatever the order: 10 of its 12 tokens; neither has caught up.
    assert p.propose_caught_up([far, near]) == [None, None]
    assert (len(p._tracked["near"].tokens), len(p._tracked["far"].tokens)) == (10, 0)
    drafts = p.propose_caught_up([far, near])  # near's last 2, then 8 of far's
    assert drafts[0] is None and drafts[1] is not None and drafts[1][:1] == [1]  # caught up
    assert len(p._tracked["far"].tokens) == 8
    for _ in range(3):
        assert p.propose_caught_up([far]) == [None]
    assert p.propose_caught_up([far]) == [[]]  # all 40 held (no loop in them: no drafts)


def test_finished_outputs_enter_and_leave_the_shared_tree_in_pieces() -> None:
    p = SuffixProposer(max_depth=4, max_cached_requests=1, max_index_tokens=5)
    first = _request("a", [1], list(range(20, 32)))  # 12 output tokens
    p.propose(first)
    p.release("a")
    assert p.backlog == 12
    p.propose(_request("x", [99], []))
    assert p.backlog == 12 - (5 - 1)  # the newcomer's 1 prompt token took its share first
    while p.backlog:
        p.propose(_request("x", [99], []))
    assert _windows(p.shared) == _windows(_tree_of(list(range(20, 32)), 4))
    second = _request("b", [1], [40, 41, 42])
    p.propose(second)
    p.release("b")  # one cached request at most: "a" leaves, in pieces too
    while p.backlog:
        p.propose(_request("x", [99], []))
    assert _windows(p.shared) == _windows(_tree_of([40, 41, 42], 4))


# ---- exactness in the engine (tiny float32 Llama on the CPU) --------------------------------

PARAMS = [SamplingParams(temperature=0, max_tokens=LENGTHS[0], ignore_eos=True),
          SamplingParams(temperature=0.7, seed=11, max_tokens=LENGTHS[1], ignore_eos=True),
          SamplingParams(temperature=0.3, seed=5, max_tokens=LENGTHS[2], ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=LENGTHS[3], ignore_eos=True)]


def _run(llm: Any) -> dict[str, list[int]]:
    outs, _ = run_steps(llm, PROMPTS, PARAMS)
    return step_tokens(outs)


@pytest.fixture(scope="module")
def plain(tiny_model_dirs: dict[str, Path]) -> dict[str, list[int]]:
    """Greedy and seeded requests in one batch, without speculation."""
    return _run(tiny_llm(tiny_model_dirs["llama"]))


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_speculation_equals_plain_decoding_greedy_and_seeded(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]], method: str) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={**SPEC, "method": method})
    assert _run(llm) == plain
    assert llm.engine.scheduler.num_draft_tokens > 0


class _Oracle(SequenceProposer):
    """The plain run's own next tokens, wrong from the third draft on: every verify step
    accepts two drafts and rejects the rest (seeded rows then draw past the emitted ones)."""

    def __init__(self, plain: dict[str, list[int]]) -> None:
        self.full = [p + plain[f"r{i}"] for i, p in enumerate(PROMPTS)]

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for seq in self.full:
            if seq[:len(token_ids)] == token_ids:
                nxt = seq[len(token_ids):len(token_ids) + k]
                return [t if j < 2 else (t + 1) % 200 for j, t in enumerate(nxt)]
        return []


def test_seeded_sampling_keeps_its_tokens_through_accepted_and_rejected_drafts(
        tiny_model_dirs: dict[str, Path], plain: dict[str, list[int]]) -> None:
    """The seeded requests' generators are set back past the rejected rows' draws."""
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={**SPEC, "method": "suffix"})
    llm.engine.proposers["suffix"] = _Oracle(plain)
    assert _run(llm) == plain
    sched = llm.engine.scheduler
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens


# ---- what the worker measures ---------------------------------------------------------------

def test_calibration_measures_step_cost_and_leaves_no_counts(
        tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={
        **SPEC, "method": "suffix", "calibration_max_batch": 4})
    engine = llm.engine
    assert engine.calibrate_speculation() > 0
    rows = [r for r, _ in engine.spec_cost.points()]
    assert rows[0] == 1 and max(rows) == 4  # plain batches 1 .. 4
    verify_rows = [r for r, _ in engine.spec_cost.points(verify=True)]
    assert verify_rows[0] == 5 and max(verify_rows) == 4 * 5  # verifying (1 + 4 rows) 1 .. 4
    assert engine.spec_tokens == (0, 0) and engine.spec_stats.items() == []
    assert engine.spec_stats.num_drafts == 0 and not engine.scheduler.requests
    assert engine.spec_rounds.allowed == {} and engine.spec_rounds.pauses == {}
    # Live steps are counted per method and class.
    run_steps(llm, PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    measured = {(m, c): a for m, c, a in engine.spec_stats.items()}
    assert measured[("suffix", "")].steps > 0
    assert sum(n for (m, _, _), n in engine.spec_rounds.allowed.items() if m == "suffix") > 0
    # The worker's other cheap proposer, measured on the same request by shadow drafts.
    assert set(measured) == {("suffix", ""), ("ngram", "")}


def test_calibration_leaves_out_each_points_warm_up(tiny_model_dirs: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A point's first decode step is slow here (as the first use of a shape is on a GPU, or
    the wait for the prompt step in an async engine): none of it reaches the step cost."""
    slow_s = 0.2
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={
        **SPEC, "method": "suffix", "calibration_max_batch": 2})
    engine = llm.engine
    launch = engine.runner.launch
    after_prompt = False

    def slow_first_decode(out: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal after_prompt
        decode = bool(out.scheduled) and all(
            s.num_new_tokens == 1 + len(s.draft_token_ids) for s in out.scheduled)
        if decode and after_prompt:
            time.sleep(slow_s)
        after_prompt = bool(out.scheduled) and not decode
        return launch(out, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", slow_first_decode)
    assert engine.calibrate_speculation() == 4 * (1 + CALIBRATION_WARMUP_STEPS + CALIBRATION_STEPS)
    points = engine.spec_cost.points() + engine.spec_cost.points(verify=True)
    assert [r for r, _ in points] == [1, 2, 5, 10]  # batches 1, 2, plain and with 4 drafts
    assert max(s for _, s in points) < slow_s / 2, points


def test_a_serving_worker_calibrates_only_while_idle(tiny_model_dirs: dict[str, Path]) -> None:
    """A point is not measured while a real request is on the engine (its steps would share
    the batch); the background driver measures them all once it is idle, through the engine
    thread, and leaves no counts."""
    llm = tiny_llm(tiny_model_dirs["llama"], speculative_config={
        **SPEC, "method": "suffix", "calibration_max_batch": 2})
    engine = llm.engine
    engine.add_request("real", list(range(3, 11)),
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert calibrate_point(engine, 1, 0) == 0 and not engine.spec_cost.points()
    engine.abort_request("real")

    async def serve() -> int:
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            return await aengine.calibrate_speculation()
        finally:
            await aengine.stop()

    # Batches 1, 2, plain and verifying: the prompts, the warm-up, the measured steps.
    assert asyncio.run(serve()) == 4 * (1 + CALIBRATION_WARMUP_STEPS + CALIBRATION_STEPS)
    assert max(r for r, _ in engine.spec_cost.points(verify=True)) == 2 * 5
    assert engine.spec_tokens == (0, 0) and engine.spec_stats.items() == []


def test_step_cost_buckets_take_the_median_and_interpolate() -> None:
    model = StepCostModel()
    for rows, seconds in [(1, 0.010), (1, 0.012), (8, 0.020), (64, 0.100)]:
        model.record(rows, seconds)
    points = model.points()
    assert [r for r, _ in points] == [1, 8, 64]
    assert points[0][1] == pytest.approx(0.011)
    cost = model.cost()
    assert cost.seconds_at(0.5) == pytest.approx(0.011)   # never below the smallest step
    assert cost.seconds_at(36) == pytest.approx(0.020 + 28 * 0.08 / 56)
    assert cost.seconds_at(128) == pytest.approx(0.100 + 64 * 0.08 / 56)  # the last slope


def test_one_slow_step_leaves_the_point_at_once_and_a_lasting_change_moves_it() -> None:
    """The H200's batch 64: a first-use step (a graph captured) of 64 rows took far longer than
    the 6.3 ms of the rest; an average weighted 0.1 to the newest read 17.6 ms for dozens of
    steps after it."""
    model = StepCostModel()
    model.record(64, 0.5)
    for _ in range(2):
        model.record(64, 0.0063)
    assert model.points() == [(64, pytest.approx(0.0063))]
    for _ in range(COST_WINDOW // 2 + 1):  # slower for good (load): followed within half the window
        model.record(64, 0.009)
    assert model.points() == [(64, pytest.approx(0.009))]


def test_step_cost_is_fitted_non_decreasing_in_rows() -> None:
    """A bucket that saw one slow step does not read dearer than the buckets above it: the
    decreasing run is pooled into its weighted mean (the 2-core machine's 2 and 3 rows at 119
    and 151 ms against 94 ms for 4 rows, each 4-row step weighing as much as the others)."""
    model = StepCostModel()
    model.record(1, 0.063)
    model.record(2, 0.119)
    model.record(3, 0.151)
    for _ in range(3):
        model.record(4, 0.094)
    model.record(8, 0.132)
    points = model.points()
    assert [r for r, _ in points] == [1, 2, 3, 4, 8]
    seconds = [s for _, s in points]
    assert seconds == sorted(seconds)
    pooled = (0.119 + 0.151 + 3 * 0.094) / 5
    assert seconds[1:4] == pytest.approx([pooled] * 3)
    assert seconds[0] == pytest.approx(0.063) and seconds[4] == pytest.approx(0.132)
    assert monotone([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert monotone([1.0, 2.0], [1.0, 5.0]) == [1.0, 2.0]


def test_acceptance_stats_decay_and_count_like_vllm() -> None:
    stats = AcceptanceStats(max_positions=3)
    stats.record("ngram", "code", 3, 2)
    stats.record("ngram", "code", 0, 0)
    stats.record("suffix", "text", 2, 0)
    a = stats.acceptance("ngram", "code")
    assert a is not None and a.steps == pytest.approx(1.995)
    tokens, rows = a.tokens_and_rows(3)
    assert tokens == pytest.approx(1 + 2 * 0.995 / 1.995)
    assert rows == pytest.approx(1 + 3 * 0.995 / 1.995)
    assert stats.num_drafts == 2 and stats.accepted_per_pos == [1, 1, 0]


def test_positions_above_a_steps_cap_say_nothing_of_the_method() -> None:
    """Ten steps at a cap of 4 (all drafted and accepted), then ten the budget held at 2: the
    3rd and 4th positions are still always drafted and accepted (they were, every time they
    were allowed), so k = 4 still reads better than k = 2 and the budget can raise the cap
    again. Counted as not drafted they fell to about half, k = 4 looked like k = 3."""
    stats = AcceptanceStats(max_positions=4)
    for _ in range(10):
        stats.record("suffix", "code", 4, 4, allowed=4)
    for _ in range(10):
        stats.record("suffix", "code", 2, 2, allowed=2)
    a = stats.acceptance("suffix", "code")
    assert a is not None and a.steps == pytest.approx(sum(0.995 ** i for i in range(20)))
    assert a.drafted[2] == pytest.approx(a.steps) and a.accepted[3] == pytest.approx(a.steps)
    assert a.tokens_and_rows(4) == pytest.approx((5.0, 5.0))
    assert a.tokens_and_rows(2) == pytest.approx((3.0, 3.0))
    # A position no step allowed yet: nothing drafted there.
    fresh = AcceptanceStats(max_positions=4)
    fresh.record("ngram", "text", 1, 1, allowed=1)
    b = fresh.acceptance("ngram", "text")
    assert b is not None and b.drafted == (1.0, 0.0, 0.0, 0.0)


def test_best_k_speculates_on_a_light_batch_and_not_on_a_compute_bound_one() -> None:
    # Flat to 16 rows (weights-bound), then 1 ms per row.
    cost = StepCost.of([(1, 0.02), (16, 0.02), (256, 0.26)])
    good = Acceptance(100, (90.0, 80.0, 70.0, 60.0), (80.0, 60.0, 45.0, 30.0))
    light = best_k(cost, good, batch=1, max_k=4)
    assert light.k == 4 and light.gain > 2
    assert best_k(cost, good, batch=64, max_k=4).k == 0
    mid = best_k(cost, good, batch=8, max_k=4)
    assert 0 < mid.k < 4  # the cap whose rows still fit the flat part pays best
    # The SLO guard: nothing whose step exceeds 25 ms while plain fits.
    assert best_k(cost, good, batch=8, max_k=4, max_step_seconds=0.025).step_seconds <= 0.025
    poor = Acceptance(100, (90.0, 80.0, 70.0, 60.0), (2.0, 1.0, 0.0, 0.0))
    assert best_k(cost, poor, batch=16, max_k=4).k == 0


# ---- --speculative-config -----------------------------------------------------------------

def _cli(*argv: str) -> Any:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv))).speculative


def test_speculative_config_json_over_the_single_flags() -> None:
    spec = _cli("--num-speculative-tokens", "3", "--speculative-config",
                '{"method": "suffix", "suffix_decoding_max_tree_depth": 16}')
    assert (spec.method, spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth) == (
        "suffix", 3, 16)
    assert _cli("--speculative-config", '{"model": "dummy:tiny"}').method == "draft_model"
    with pytest.raises(SystemExit):
        _cli("--speculative-config", '{"methd": "ngram"}')
    with pytest.raises(ConfigError, match="unknown key"):
        parse_speculative_config('{"num_speculative_token": 4}')
    with pytest.raises(ConfigError, match="num_speculative_tokens must be int"):
        parse_speculative_config('{"num_speculative_tokens": "4"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_speculative_config("{method: ngram}")
