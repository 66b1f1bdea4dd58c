"""The adaptive speculative policy (gateway/spec_policy.py): the choice from a worker's reported
step cost and acceptance for the request's class and the worker's load, the SLO guard,
exploration of unmeasured proposers, the fallbacks, and its series on /metrics
(gateway/spec_metrics.py). Workers here are router entries holding a load report as a poll
would have left it; the real worker's reports are in tests/e2e/test_e2e_spec.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_api.spec_gain import Acceptance, StepCost, best_k, choices
from gateway.config import GatewayConfig, GatewayConfigError
from gateway.metrics import GatewayMetrics
from gateway.router import Worker
from gateway.spec_policy import EXPLORE_EVERY, MIN_GAIN, SpecPolicy, request_class
from protos.splitserve.v1 import common_pb2

NGRAM = common_pb2.SPECULATIVE_METHOD_NGRAM
SUFFIX = common_pb2.SPECULATIVE_METHOD_SUFFIX
DRAFT = common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL
ADDRESS = "127.0.0.1:50062"
# Flat up to 16 rows (a weights-bound step), then 1 ms per row.
COST = [(1.0, 0.02), (16.0, 0.02), (256.0, 0.26)]
# Per draft position of 100 steps: drafted, accepted.
GOOD = ([95.0, 90.0, 85.0, 80.0], [85.0, 70.0, 60.0, 50.0])
POOR = ([60.0, 50.0, 40.0, 30.0], [1.0, 0.0, 0.0, 0.0])


def _acceptance(method: int, cls: str, numbers: tuple[list[float], list[float]],
                steps: float = 100.0) -> common_pb2.SpecAcceptance:
    return common_pb2.SpecAcceptance(method=method, request_class=cls,  # type: ignore[arg-type]
                                     steps=steps, drafted=numbers[0], accepted=numbers[1])


def _worker(running: int, acceptance: Sequence[common_pb2.SpecAcceptance],
            cost: Sequence[tuple[float, float]] = COST,
            methods: Sequence[int] = (NGRAM, SUFFIX),
            verify_cost: Sequence[tuple[float, float]] = (),
            verify_pad: tuple[int, int] = (0, 0)) -> Worker:
    report = common_pb2.LoadReport(
        spec_verify_pad_rows=verify_pad[0], spec_verify_pad_max_seqs=verify_pad[1],
        num_running=running, speculative_methods=methods,  # type: ignore[arg-type]
        max_speculative_tokens=4,
        spec_step_cost=[common_pb2.SpecStepCost(rows=r, seconds=s) for r, s in cost]
        + [common_pb2.SpecStepCost(rows=r, seconds=s, verify=True) for r, s in verify_cost],
        spec_acceptance=acceptance)
    w = Worker(ADDRESS, None)  # type: ignore[arg-type]  # no calls: the policy reads the report
    w.apply_report(report)
    w.in_flight = w.in_flight_at_poll = 1  # the request being routed, as `pick` counts it
    return w


def _config(**kw: object) -> GatewayConfig:
    return GatewayConfig(decode_addresses=(ADDRESS,), colocated=True, **kw)  # type: ignore[arg-type]


MEASURED = [_acceptance(NGRAM, "repetitive", POOR), _acceptance(SUFFIX, "repetitive", GOOD),
            _acceptance(NGRAM, "text", POOR), _acceptance(SUFFIX, "text", POOR)]


def test_the_best_method_and_drafts_for_the_class_and_load() -> None:
    policy = SpecPolicy(_config())
    light = policy.decide(_worker(0, MEASURED), "repetitive")
    assert (light.label, light.num_speculative_tokens, light.reason) == ("suffix", 4, "measured")
    assert light.predicted_gain > 2 and 2 < light.accepted_per_step < 3
    # At 8 other requests, 9 sequences x 5 rows is past the flat part: fewer drafts pay best
    # now. The cap sent stays at 4: the worker lowers each step's drafts as its batch is then.
    mid = policy.decide(_worker(8, MEASURED), "repetitive")
    assert mid.label == "suffix" and 0 < mid.predicted_k < 4 and mid.num_speculative_tokens == 4
    # Compute-bound: every row costs; off.
    assert not policy.decide(_worker(100, MEASURED), "repetitive").enabled
    # Free text accepts too little at any load.
    text = policy.decide(_worker(0, MEASURED), "text")
    assert (text.label, text.reason) == ("off", "measured")


def test_the_slo_guard_and_the_workers_cap() -> None:
    guarded = SpecPolicy(_config(speculative_tpot_slo_ms=25.0)).decide(
        _worker(8, MEASURED), "repetitive")
    # The predicted step and the cap sent both within the target (9 x 5 rows would miss it).
    assert guarded.step_seconds <= 0.025
    assert guarded.predicted_k <= guarded.num_speculative_tokens < 4
    capped = SpecPolicy(_config(speculative_tokens=2)).decide(_worker(0, MEASURED), "repetitive")
    assert capped.num_speculative_tokens == 2


def test_an_unmeasured_method_or_class_is_explored_then_draft_model_losers_now_and_then() -> None:
    policy = SpecPolicy(_config())
    # Nothing measured for "tools" and not enough pooled either: both proposers tried.
    sparse = [_acceptance(NGRAM, "text", POOR, steps=4.0)]
    tried = {policy.decide(_worker(0, sparse), "tools").label for _ in range(2)}
    assert tried == {"ngram", "suffix"}
    # A class without numbers of its own falls back to its method's pooled numbers.
    pooled = policy.decide(_worker(0, MEASURED), "tools")
    assert pooled.reason == "measured" and pooled.label == "suffix"
    # Measured and losing: off. The worker measures n-gram and suffix decoding on requests
    # that do not use them (shadow drafts), so they are not explored with real requests...
    reasons = [policy.decide(_worker(0, MEASURED), "text").reason
               for _ in range(EXPLORE_EVERY)]
    assert reasons == ["measured"] * EXPLORE_EVERY
    # ... but a draft model that lost is tried again every EXPLORE_EVERY-th decision.
    drafts = [*MEASURED, _acceptance(DRAFT, "text", POOR)]
    chosen = [policy.decide(_worker(0, drafts, methods=(DRAFT, NGRAM, SUFFIX)), "text")
              for _ in range(EXPLORE_EVERY)]
    assert [(d.label, d.reason) for d in chosen if d.reason == "explore"] == [
        ("draft_model", "explore")]
    assert sum(d.reason == "measured" for d in chosen) == EXPLORE_EVERY - 1


def test_fallbacks_always_and_a_named_method() -> None:
    # No cost reported yet: the load threshold rule (n-gram below speculative_max_load).
    bare = _worker(0, [], cost=[])
    d = SpecPolicy(_config()).decide(bare, "text")
    assert (d.label, d.reason) == ("ngram", "threshold")
    always = SpecPolicy(_config(speculative_policy="always",
                                speculative_policy_method="suffix")).decide(
        _worker(100, MEASURED), "text")
    assert (always.label, always.num_speculative_tokens, always.reason) == ("suffix", 4, "always")
    only_ngram = SpecPolicy(_config(speculative_policy_method="ngram")).decide(
        _worker(0, MEASURED), "repetitive")
    assert only_ngram.label in ("ngram", "off")
    with pytest.raises(GatewayConfigError, match="speculative_policy"):
        _config(speculative_policy="sometimes")
    with pytest.raises(GatewayConfigError, match="speculative_tpot_slo_ms"):
        _config(speculative_tpot_slo_ms=-1.0)


def test_verify_steps_are_priced_by_the_workers_verify_points() -> None:
    """The same plain steps; where the worker measured its verify steps at four times a plain
    step of their rows (the rejection sampler, no overlap with the next launch, on a small
    model), suffix decoding's 3.65 tokens per step no longer pay."""
    policy = SpecPolicy(_config())
    assert policy.decide(_worker(0, MEASURED), "repetitive").label == "suffix"
    dear = [(5.0, 0.08), (80.0, 0.24)]
    decision = SpecPolicy(_config()).decide(_worker(0, MEASURED, verify_cost=dear), "repetitive")
    assert (decision.label, decision.reason) == ("off", "measured")


def test_a_worker_whose_verify_graph_pads_the_drafts_is_priced_at_the_graphs_rows() -> None:
    """Verify steps rising with their rows as measured eagerly; the worker says its verify graph
    computes 5 rows for each of up to 64 sequences. At 20 sequences fewer drafts would read
    cheaper; padded, every cap costs 100 rows, and the most drafts pay best."""
    verify = [(5.0, 0.02), (40.0, 0.03), (100.0, 0.06), (320.0, 0.14)]
    eager = SpecPolicy(_config()).decide(_worker(19, MEASURED, verify_cost=verify), "repetitive")
    assert eager.label == "suffix" and 0 < eager.predicted_k < 4
    padded = SpecPolicy(_config()).decide(
        _worker(19, MEASURED, verify_cost=verify, verify_pad=(5, 64)), "repetitive")
    assert (padded.label, padded.predicted_k) == ("suffix", 4)
    # Past the graph's sequences the drafts asked are priced again.
    big = SpecPolicy(_config()).decide(
        _worker(19, MEASURED, verify_cost=verify, verify_pad=(5, 16)), "repetitive")
    assert big.predicted_k == eager.predicted_k


def test_request_classes() -> None:
    code = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    prose = list(range(100, 140))
    assert request_class(code) == "repetitive"
    assert request_class(prose) == "text"
    assert request_class(prose, has_tools=True) == "tools"
    assert request_class([1, 2, 3]) == "text"
    assert request_class(prose, text="Fix this:\n```python\nx = 1\n```") == "code"
    assert request_class(prose, text="int f() {\n  a();\n  return b;\n}") == "code"
    assert request_class(prose, text="Once upon a time; a fox.\nThe end.") == "text"


def test_metrics_show_the_decisions_and_the_workers_numbers() -> None:
    metrics = GatewayMetrics()
    worker = _worker(0, MEASURED)
    worker.load.spec_num_drafts = 7
    worker.load.spec_accepted_tokens_per_pos.extend([6, 4, 1, 0])
    worker.load.spec_draft_rounds.add(method=common_pb2.SPECULATIVE_METHOD_SUFFIX,
                                      request_class="code", num_speculative_tokens=2, rounds=9)
    worker.load.spec_pauses.add(method=common_pb2.SPECULATIVE_METHOD_NGRAM,
                                request_class="text", pauses=3)
    metrics.observe_workers("decode", [worker])
    metrics.observe_spec_decision(ADDRESS, SpecPolicy(_config()).decide(worker, "repetitive"))
    # Every gateway series carries model_name (gateway/request_metrics.py); left out here.
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
               s.value
               for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}
    who = (("role", "decode"), ("worker", ADDRESS))
    assert samples[("splitserve:spec_decode_num_drafts_total", who)] == 7
    assert samples[("splitserve:spec_decode_num_accepted_tokens_per_pos_total",
                    (("position", "1"), *who))] == 4
    assert samples[("splitserve:spec_decode_step_seconds", (*who[:1], ("rows", "16.0"),
                                                            ("step", "plain"), who[1]))] == 0.02
    accepted = samples[("splitserve:spec_decode_accepted_per_step",
                        (("method", "suffix"), ("request_class", "repetitive"), *who))]
    assert accepted == pytest.approx(2.65)
    assert samples[("splitserve:spec_decode_draft_rounds_total", (
        ("method", "suffix"), ("num_speculative_tokens", "2"), ("request_class", "code"),
        *who))] == 9
    assert samples[("splitserve:spec_decode_pauses_total", (
        ("method", "ngram"), ("request_class", "text"), *who))] == 3
    assert samples[("splitserve:spec_decode_policy_decisions_total", (
        ("method", "suffix"), ("num_speculative_tokens", "4"), ("reason", "measured"),
        ("request_class", "repetitive"), ("worker", ADDRESS)))] == 1
    assert samples[("splitserve:spec_decode_decisions_total", (("speculation", "suffix"),))] == 1


def test_the_gateways_own_requests_in_flight_count_as_decided() -> None:
    """Seven requests of this gateway run plain there (free text, off): the eighth speculates
    into the step's flat part with all its drafts. Once they are gone, the same load of
    unseen requests is assumed to speculate alike: fewer drafts pay."""
    policy = SpecPolicy(_config())
    plain = [policy.decide(_worker(i, MEASURED), "text") for i in range(7)]
    assert not any(d.enabled for d in plain)
    eighth = policy.decide(_worker(7, MEASURED), "repetitive")
    assert (eighth.label, eighth.predicted_k) == ("suffix", 4)
    for d in [*plain, eighth]:
        policy.release(ADDRESS, d)
    alone = policy.decide(_worker(7, MEASURED), "repetitive")
    assert alone.label == "suffix" and 0 < alone.predicted_k < 4


def test_a_near_tie_on_the_batch_goes_to_the_requests_own_speed() -> None:
    """Four of this gateway's requests already run on the worker (2 tokens from 3 rows per
    step each). For the fifth, 3 drafts give the batch's best rate and 4 drafts a rate within
    TIE_BAND of it, but 4 make the request itself ~10% faster: 4 are predicted."""
    suffix = ([100.0, 100.0, 100.0, 100.0], [90.0, 70.0, 60.0, 50.0])
    known = (4, 8.0, 12.0)
    acceptance = Acceptance(100.0, tuple(suffix[0]), tuple(suffix[1]))
    assert best_k(StepCost.of(COST), acceptance, 5, 4, known=known).k == 3  # the premise
    policy = SpecPolicy(_config())
    policy._held[ADDRESS] = known  # what 4 earlier decisions left in flight there
    chosen = policy.decide(_worker(5, [_acceptance(SUFFIX, "code", suffix)], methods=(SUFFIX,)),
                           "code")
    assert (chosen.label, chosen.reason, chosen.predicted_k) == ("suffix", "measured", 4)
    assert chosen.num_speculative_tokens == 4


def test_at_the_margin_a_request_speculates_rather_than_go_slow() -> None:
    """Ten of this gateway's requests verify suffix drafts on a compute-bound worker. For the
    eleventh no cap beats plain decoding by MIN_GAIN's margin on the batch (it adds ~0.1%
    whatever it does), yet with 4 drafts it emits 2.45 tokens per step against 1 off: the
    near tie goes to speculation."""
    text = ([85.0, 49.0, 33.0, 29.0], [63.0, 32.0, 26.0, 24.0])  # 2.45 tokens, 2.96 rows
    acceptance = Acceptance(100.0, tuple(text[0]), tuple(text[1]))
    known = (10, 10 * 2.45, 10 * 2.96)
    assert choices(StepCost.of(COST), acceptance, 11, 4, min_gain=MIN_GAIN,
                   known=known)[1] == []  # the premise: none passes the margin
    policy = SpecPolicy(_config())
    policy._held[ADDRESS] = known
    chosen = policy.decide(_worker(11, [_acceptance(SUFFIX, "text", text)], methods=(SUFFIX,)),
                           "text")
    assert (chosen.label, chosen.reason) == ("suffix", "measured")


def test_a_class_keeps_its_method_until_another_is_clearly_better() -> None:
    """Hysteresis (HOLD_GAIN): a worker and class that speculate with suffix decoding keep it
    while n-gram lookup is predicted ~8% better, and switch once it is ~30% better."""
    slightly = ([100.0] * 4, [100.0, 90.0, 60.0, 45.0])  # 3.95 tokens a step against 3.65
    clearly = ([100.0] * 4, [100.0, 100.0, 95.0, 85.0])  # 4.8
    def reports(ngram: tuple[list[float], list[float]]) -> list[common_pb2.SpecAcceptance]:
        return [_acceptance(NGRAM, "code", ngram), _acceptance(SUFFIX, "code", GOOD)]
    # The premise: without a history n-gram's 8% wins.
    assert SpecPolicy(_config()).decide(_worker(0, reports(slightly)), "code").label == "ngram"
    policy = SpecPolicy(_config())
    assert policy.decide(_worker(0, reports(POOR)), "code").label == "suffix"
    assert policy.decide(_worker(0, reports(slightly)), "code").label == "suffix"
    assert policy.decide(_worker(0, reports(clearly)), "code").label == "ngram"
    # Now n-gram holds the class; the worker and other classes have their own.
    assert policy.decide(_worker(0, reports(slightly)), "code").label == "ngram"
    assert policy.decide(_worker(0, [_acceptance(NGRAM, "text", slightly),
                                     _acceptance(SUFFIX, "text", GOOD)]), "text").label == "ngram"


def test_speculation_starts_at_min_gain_and_stops_at_a_predicted_loss() -> None:
    """A 5% predicted gain does not start speculation (MIN_GAIN) but keeps it going once it
    runs; a predicted loss stops it."""
    marginal = ([100.0] * 4, [5.0, 0.0, 0.0, 0.0])  # 1.05 tokens a step from free rows
    assert not SpecPolicy(_config()).decide(  # the premise
        _worker(0, [_acceptance(SUFFIX, "text", marginal)], methods=(SUFFIX,)), "text").enabled
    policy = SpecPolicy(_config())
    good = policy.decide(_worker(0, [_acceptance(SUFFIX, "text", GOOD)], methods=(SUFFIX,)),
                         "text")
    assert good.label == "suffix"
    kept = policy.decide(_worker(0, [_acceptance(SUFFIX, "text", marginal)], methods=(SUFFIX,)),
                         "text")
    assert (kept.label, kept.reason) == ("suffix", "measured")
    # Compute-bound (every row costs): 5% more tokens for ~2x the rows is a loss.
    assert not policy.decide(_worker(100, [_acceptance(SUFFIX, "text", marginal)],
                                     methods=(SUFFIX,)), "text").enabled
    # ... and off again, 5% no longer starts it.
    assert not policy.decide(_worker(0, [_acceptance(SUFFIX, "text", marginal)],
                                     methods=(SUFFIX,)), "text").enabled


def test_off_for_the_load_is_left_to_a_budgeting_worker() -> None:
    """On a compute-bound worker drafting does not pay now. A worker that budgets each step's
    drafts gets the request with suffix decoding and the full cap (it holds the drafts at none
    while they do not pay and lets them run as the batch thins); one that does not, or under an
    SLO, gets it off; a class whose drafts would not pay on a light worker either stays off."""
    busy = _worker(100, MEASURED)
    assert not SpecPolicy(_config()).decide(busy, "repetitive").enabled  # the premise
    busy.load.spec_step_budget = True
    policy = SpecPolicy(_config())
    left = policy.decide(busy, "repetitive")
    assert (left.label, left.num_speculative_tokens, left.reason) == ("suffix", 4, "budget")
    # Counted in flight as the worker will run it now: plain.
    assert (left.accepted_per_step, left.rows_per_step, left.predicted_k) == (0.0, 1.0, 0)
    assert policy._held[ADDRESS] == (1, 1.0, 1.0)
    assert (policy.decide(busy, "text").label, policy.decide(busy, "text").reason) == (
        "off", "measured")
    guarded = SpecPolicy(_config(speculative_tpot_slo_ms=500.0)).decide(busy, "repetitive")
    assert not guarded.enabled
