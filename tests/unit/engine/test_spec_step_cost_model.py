"""The step-cost model (engine/spec/cost.py): a step's time is its rows' cost plus a cost per
KV token its attention reads, fitted from the steps themselves, so a curve fed by long prompts
does not price the drafts of short ones (on the CPU a 48-row step of code edits took 405 ms
against 319 for stories: bench/results/cpu_spec_budget_trace/); plain and verify steps on
curves of their own."""

from __future__ import annotations

import random

import pytest

from engine.spec.budget import MIN_MEASURED_STEPS, StepBudget
from engine.spec.cost import COST_WINDOW, REFIT_EVERY, StepCostModel, context_slope
from engine.spec.stats import AcceptanceStats
from engine_api.spec_gain import Acceptance, StepCost, best_k

PER_ROW_S = 0.008        # compute-bound rows, as SmolLM2 on the 2-core machine
PER_KV_TOKEN_S = 4e-5    # the attention's part
COST_WINDOW_STEPS = COST_WINDOW


def _seconds(rows: int, kv: float, rng: random.Random, noise: float = 0.02) -> float:
    return (0.02 + PER_ROW_S * rows + PER_KV_TOKEN_S * kv) * (1 + rng.uniform(-noise, noise))


def _feed(model: StepCostModel, steps: list[tuple[int, int, int]], rng: random.Random) -> None:
    """Steps of (rows, sequences, context per sequence), each fed 2 * REFIT_EVERY times with
    the context growing a token a step (decoding)."""
    for rows, seqs, ctx in steps:
        for t in range(2 * REFIT_EVERY):
            kv = seqs * (ctx + t)
            model.record(rows, _seconds(rows, kv, rng), kv, seqs)


def test_the_slope_per_kv_token_is_measured_within_buckets() -> None:
    rng = random.Random(0)
    model = StepCostModel()
    # Plain and 4-draft steps at 4, 8 and 16 sequences, short prompts then long ones.
    _feed(model, [(b * (1 + k), b, ctx) for ctx in (50, 150) for b in (4, 8, 16) for k in (0, 4)],
          rng)
    assert model.per_kv_token == pytest.approx(PER_KV_TOKEN_S, rel=0.15)
    assert model.context_per_sequence == pytest.approx(150 + 2 * REFIT_EVERY - 1, rel=0.1)
    # The curve at a batch's context: the same rows cost what that context makes them cost.
    for rows, kv in ((16, 4 * 60), (40, 8 * 60), (80, 16 * 170)):
        assert model.cost(kv).seconds_at(rows) == pytest.approx(
            0.02 + PER_ROW_S * rows + PER_KV_TOKEN_S * kv, rel=0.05)


def test_rows_seen_only_with_long_prompts_are_priced_for_short_ones() -> None:
    """The probe's order: code edits (long prompts) at every batch first, then stories (short
    prompts) only plain. The rows above the stories' plain steps were only ever seen with long
    prompts; a story batch's drafts are priced at the stories' context, not the code edits'."""
    rng = random.Random(1)
    model = StepCostModel()
    _feed(model, [(b * (1 + k), b, 150) for b in (4, 16) for k in (0, 4)], rng)
    _feed(model, [(b, b, 40) for b in (4, 16)], rng)
    short_kv = 16 * 50
    predicted = model.cost(short_kv).seconds_at(80)
    true = 0.02 + PER_ROW_S * 80 + PER_KV_TOKEN_S * short_kv
    long_only = 0.02 + PER_ROW_S * 80 + PER_KV_TOKEN_S * 16 * 165  # what the bucket holds
    assert predicted == pytest.approx(true, rel=0.05)
    assert abs(predicted - true) < 0.25 * (long_only - true)


def test_no_slope_where_the_context_never_varies_apart_from_the_rows() -> None:
    """Context per row constant (kv a fixed multiple of rows): rows and context cannot be told
    apart, so the curve over rows keeps the time and the slope stays 0."""
    model = StepCostModel()
    for _ in range(4):
        for rows in (16, 17, 18, 19, 20, 21, 22):  # one half-octave bucket
            model.record(rows, 0.02 + 0.01 * rows, 100.0 * rows, rows)
    model.record(1, 0.02, 100.0, 1)
    assert model.per_kv_token == 0.0
    assert model.cost(10_000).seconds_at(19) == pytest.approx(0.21, rel=0.05)


def test_noise_without_a_context_effect_gives_no_slope_and_a_stall_does_not_make_one() -> None:
    for seed in range(10):
        rng = random.Random(seed)
        steps = [[(rows, float(rng.randrange(400, 4000)),
                   0.05 * rows * (1 + rng.uniform(-0.1, 0.1))) for _ in range(64)]
                 for rows in (8, 32)]
        assert context_slope(steps) == 0.0, seed
        # A collection (a second) in a bucket's longest-context step: left out as an outlier.
        rows, kv, _ = max(steps[0], key=lambda s: s[1])
        steps[0].append((rows, kv + 1, 1.0))
        assert context_slope(steps) == 0.0, seed
    # The same steps with a context effect: measured.
    rng = random.Random(0)
    steps = [[(rows, kv, 0.05 * rows * (1 + rng.uniform(-0.1, 0.1)) + PER_KV_TOKEN_S * kv)
              for kv in (float(rng.randrange(400, 4000)) for _ in range(64))] for rows in (8, 32)]
    assert context_slope(steps) == pytest.approx(PER_KV_TOKEN_S, rel=0.3)


def test_a_batchs_last_steps_and_calibration_do_not_make_a_slope() -> None:
    """GPU-like steps (H100 traces, bench/results/h100/spec_step_trace/): steady runs of 32
    sequences, 4e-8 s per KV token; the batches' last steps (29-31 sequences, the same rows
    bucket, long contexts, 5 ms of the host's work for the requests that ended); start-up
    calibration at short contexts on an idle host. The slope is fitted within each shape of
    step, calibration left out."""
    rng = random.Random(3)
    model = StepCostModel()
    model.fit_context = False  # calibration
    for _ in range(8):
        model.record(32, 0.0060 * (1 + rng.uniform(-0.01, 0.01)), 32 * 16, 32)
    model.fit_context = True
    gpu_s = 4e-8
    for _ in range(3):  # three batches
        for t in range(40):
            kv = 32 * (512 + t)
            model.record(32, (0.0048 + gpu_s * kv) * (1 + rng.uniform(-0.005, 0.005)), kv, 32)
        for seqs in (31, 30, 29):  # the batch ends
            model.record(seqs, 0.0048 + gpu_s * seqs * 640 + 0.005, seqs * 640, seqs)
    assert model.per_kv_token == pytest.approx(gpu_s, rel=0.3)
    # The steady batch's step, at its context.
    assert model.cost(32 * 540).seconds_at(32) == pytest.approx(0.0048 + gpu_s * 32 * 540,
                                                                rel=0.05)


def test_stalls_in_a_noisy_shape_do_not_make_a_slope() -> None:
    """Precise steps of 1-16 sequences (4e-8 s per KV token) beside steady steps of 128
    sequences at 9.5 +- 0.5 ms with three stalls (40, 60, 175 ms) late in the run, as on a lent
    H100. Outliers were trimmed about a first pooled fit that the stalls had made steep, with
    the precise groups' small spread as the threshold for all: the noisy group kept the steps
    that agreed with it, and the fit read about 1.9e-6. Trimmed by each group's own spread, the
    stalls go and nothing steep is left."""
    for seed in range(5):
        rng = random.Random(seed)
        gpu_s = 4e-8
        groups = [[(seqs, seqs * (512.0 + t),
                    0.005 + gpu_s * seqs * (512 + t) + rng.gauss(0, 2e-6)) for t in range(64)]
                  for seqs in (1, 2, 4, 8, 16)]
        big = [(128, 128 * (512.0 + t), 0.0095 + rng.uniform(-0.0005, 0.0005)) for t in range(64)]
        for t, stall in ((55, 0.04), (60, 0.06), (63, 0.175)):
            big[t] = (128, big[t][1], stall)
        assert context_slope([*groups, big]) < 2 * gpu_s, seed


def test_plain_and_verify_steps_have_a_context_cost_of_their_own() -> None:
    """Verify steps of 16 sequences whose time grows with the context by the host's drafting (an
    n-gram lookup reads the whole context: 1.5e-6 s per KV token, as on an H100), plain steps
    that overlap it (4e-8, the attention alone). One slope for both priced plain steps at the
    verify steps' growth."""
    rng = random.Random(4)
    model = StepCostModel()
    for _ in range(3):  # three runs of each
        for t in range(48):
            kv = 16 * (512 + t)
            model.record(16, (0.0060 + 4e-8 * kv) * (1 + rng.uniform(-0.002, 0.002)), kv, 16)
        for t in range(0, 96, 2):
            kv = 16 * (512 + t)
            model.record(80, (0.0080 + 1.5e-6 * kv) * (1 + rng.uniform(-0.002, 0.002)), kv, 16,
                         verify=True)
    assert model.per_kv_token == pytest.approx(4e-8, rel=0.3)
    assert model.verify_per_kv_token == pytest.approx(1.5e-6, rel=0.1)
    cost = model.cost(16 * 2048)  # four times the context
    assert cost.seconds_at(16) == pytest.approx(0.0060 + 4e-8 * 16 * 2048, rel=0.03)
    assert cost.seconds_at(80, verify=True) == pytest.approx(0.0080 + 1.5e-6 * 16 * 2048,
                                                             rel=0.03)


def test_the_budget_prices_drafts_at_its_batchs_own_context() -> None:
    """Drafts add rows, not KV reads: where a batch's long contexts make every step dear, a
    draft accepted half the time pays; where its contexts are short, the same acceptance does
    not (16 sequences: 0.5 > 0.128 / (0.02 + 0.27 + 0.128), 0.5 < 0.128 / (0.02 + 0.04 + 0.128)).
    One curve over rows alone gave both batches the same cap."""
    rng = random.Random(3)
    cost = StepCostModel()
    _feed(cost, [(b * (1 + k), b, ctx) for ctx in (50, 400) for b in (8, 16) for k in (0, 1, 4)],
          rng)
    assert cost.per_kv_token == pytest.approx(PER_KV_TOKEN_S, rel=0.15)
    stats = AcceptanceStats(4)
    for i in range(int(MIN_MEASURED_STEPS) + 4):
        stats.record("suffix", "text", 1, i % 2, allowed=4)
    budget = StepBudget(cost, stats, 4)
    assert budget.cap_for({}, "suffix", "text", 16, 4, 16 * 60) == 0
    assert budget.cap_for({}, "suffix", "text", 16, 4, 16 * 420) == 1


def test_plain_and_verify_steps_have_curves_of_their_own() -> None:
    """A verify step of the same rows costs more than a plain one (the rejection sampler, no
    overlap with the next launch): plain steps are priced by plain steps alone, so verify steps
    of small batches do not make the plain steps of larger ones look dear."""
    model = StepCostModel()
    for _ in range(COST_WINDOW_STEPS):
        model.record(16, 0.0065, verify=False)   # 16 sequences, plain
        model.record(20, 0.0110, verify=True)    # 4 sequences x 5 rows, verifying
        model.record(80, 0.0130, verify=True)
        model.record(64, 0.0072, verify=False)
    cost = model.cost()
    assert cost.seconds_at(16) == pytest.approx(0.0065)
    assert cost.seconds_at(20) == pytest.approx(0.0065 + 4 * (0.0072 - 0.0065) / 48)
    assert cost.seconds_at(20, verify=True) == pytest.approx(0.0110)
    assert cost.seconds_at(64, verify=True) == pytest.approx(0.0110 + 44 * 0.002 / 60)
    # Its own curve, even where it is below the plain one (a sequence's rows share its KV).
    cheap = StepCost.of([(16, 0.0065), (64, 0.0200)], [(20, 0.0110), (80, 0.0130)])
    assert cheap.seconds_at(64, verify=True) == pytest.approx(0.0110 + 44 * 0.002 / 60)
    # No verify step timed yet: the plain curve prices both.
    assert StepCost.of([(16, 0.0065)]).seconds_at(16, verify=True) == pytest.approx(0.0065)


def test_the_policy_weighs_verify_steps_against_plain_ones() -> None:
    """Batch 16 at 30% acceptance of 1 draft: on one curve 32 rows cost what 16 plus a
    little do, and the draft pays; priced as a verify step (10 ms against 6.5) it does not."""
    acceptance = Acceptance(100.0, (100.0, 0.0, 0.0, 0.0), (30.0, 0.0, 0.0, 0.0))
    one_curve = StepCost.of([(16, 0.0065), (32, 0.0070)])
    assert best_k(one_curve, acceptance, 16, 4).k == 1
    both = StepCost.of([(16, 0.0065), (32, 0.0070)], [(32, 0.0100)])
    assert best_k(both, acceptance, 16, 4).k == 0
