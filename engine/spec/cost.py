"""A decode worker's measured step cost: seconds per step by the step's query rows (a plain
sequence is one row, a verifying one 1 + its drafts; a verify graph's padded rows where it ran
one) and the KV tokens its attention reads, plain and verify steps apart, smoothed, for the
speculation policy (engine_api/spec_gain.py) here and at the gateway (LoadReport.spec_step_cost).

A step's time is modelled as `base(rows) + per_kv_token * kv_tokens`: `kv_tokens` sums the
step's sequences' context lengths (the GPU's verify kernel reads each KV tile once for all of a
sequence's query rows, so drafts add rows, not KV reads). One curve over rows alone mixed
workloads: on the CPU a 48-row step of code edits (prompts ~3x longer) took 405 ms against 319
for stories, and a curve last fed by code edits held stories' drafts at a cap too low
(bench/results/cpu_spec_budget_trace/). The curve is asked for at the batch's own context.

Steps are grouped by rows in half-octave buckets (1, 1.4, 2, 2.8, 4, ...); each bucket keeps
its last FIT_WINDOW steps. `per_kv_token` (one per curve) is fitted by least squares within
each shape of step (its rows and sequences: KV tokens against seconds, about the shape's means,
so neither the rows' own slope nor a batch's last steps are taken for the context's;
`_Bucket.by_shape`, `context_slope`), refitted every REFIT_EVERY steps, and kept at 0 until its
standard error says it is measured. A bucket's point is its last COST_WINDOW steps' mean rows
and median seconds less their context's part, so the points follow the worker's own hardware,
model and load mix within a few steps, and a step slowed once (a shape's first use: a CUDA
graph captured, a kernel compiled; a collection; a stall) is out of the point at once. With a
moving average (weight 0.1 to the newest) one such step held the H200's 64-row point at
17.6 ms against 6.3 ms measured for dozens of steps after it, and the policy took four drafts
per sequence for nearly free. Start-up calibration (calibrate.py) fills them before the first
request; live steps refresh them. Only pure decode steps count: a prompt chunk in the step
would charge its compute to the rows.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from engine_api.spec_gain import StepCost

# Steps a bucket's point stands on: its median follows a lasting change within COST_WINDOW / 2
# steps.
COST_WINDOW = 16
# Steps a bucket keeps for the context fit: more than a point needs, so that each bucket holds
# steps of more than one context.
FIT_WINDOW = 64
REFIT_EVERY = 16
# The context slope is used once it is this many standard errors above 0.
MIN_T = 3.0
# Residuals beyond this many robust standard deviations (MAD) leave the fit: a collection, a
# stall, a shape's first use.
OUTLIER_SIGMAS = 4.0
# A step's context part never takes more than this of its time (an overestimated slope must
# not make a point free).
MAX_CONTEXT_SHARE = 0.9
# A bucket's weight in the monotone fit: its steps, up to about what its median stands on.
MAX_WEIGHT = COST_WINDOW
# Weight of the newest step in the mean context per sequence.
CONTEXT_SMOOTHING = 0.1


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent
    violators: a run that decreases is replaced by its weighted mean)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, max(w, 1e-9), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]


def context_slope(groups: list[list[tuple[int, float, float]]]) -> float:
    """Seconds per KV token from steps (rows, kv_tokens, seconds), each group one shape of step
    (`_Bucket.by_shape`): per group the least-squares slope of seconds on KV tokens about the
    group's means, weighted by its spread of KV tokens. Their weighted mean (pooled least
    squares) must be at least MIN_T standard errors, else 0.0; the estimate is the lower of it
    and the weighted median: alone, the mean let one group whose steps differed in more than
    their context (the host busier at one end: a probe's sweep beside live steps of its shape)
    carry the slope. A group's outliers (a collection, a stall) go first, by its own spread of
    times: trimmed about a first pooled fit instead, with one threshold for all groups, a noisy
    group kept the steps that agreed with that fit, and an overestimate confirmed itself (on an
    H100, 1.1e-6 s per KV token from steady 9.5 ms steps)."""
    centred: list[list[tuple[float, float]]] = []
    for g in groups:
        times = [s for _, _, s in g]
        if len(times) >= 3:
            mid = statistics.median(times)
            mad = statistics.median(abs(t - mid) for t in times)
            if mad > 0:
                g = [step for step in g if abs(step[2] - mid) <= OUTLIER_SIGMAS * 1.4826 * mad]
        if len(g) < 2:
            continue
        mk = sum(k for _, k, _ in g) / len(g)
        ms = sum(s for _, _, s in g) / len(g)
        devs = [(k - mk, s - ms) for _, k, s in g]
        if any(dk for dk, _ in devs):
            centred.append(devs)
    pooled = _pooled_slope(centred)
    if pooled is None:
        return 0.0
    slopes: list[tuple[float, float]] = []  # (slope, weight) per group
    rss = 0.0
    skk_all = 0.0
    for devs in centred:
        skk = sum(dk * dk for dk, _ in devs)
        slopes.append((sum(dk * ds for dk, ds in devs) / skk, skk))
        rss += sum((ds - pooled * dk) ** 2 for dk, ds in devs)
        skk_all += skk
    dof = sum(len(devs) - 1 for devs in centred) - 1
    if dof <= 0:
        return 0.0
    se = math.sqrt(rss / dof / skk_all)
    if pooled < MIN_T * se:
        return 0.0
    return max(0.0, min(pooled, _weighted_median(slopes)))


def _pooled_slope(centred: list[list[tuple[float, float]]]) -> float | None:
    skk = sum(dk * dk for devs in centred for dk, _ in devs)
    if skk <= 0:
        return None
    return sum(dk * ds for devs in centred for dk, ds in devs) / skk


def _weighted_median(values: list[tuple[float, float]]) -> float:
    """The value at half the total weight of (value, weight) pairs."""
    ordered = sorted(values)
    half = sum(w for _, w in ordered) / 2
    seen = 0.0
    for v, w in ordered:
        seen += w
        if seen >= half:
            return v
    return ordered[-1][0]


@dataclass(slots=True)
class _Bucket:
    steps: deque[tuple[int, float, float]] = field(
        default_factory=lambda: deque(maxlen=FIT_WINDOW))  # (rows, kv_tokens, seconds)
    # Each step's shape (rows, sequences) for the context fit; None: left out of it.
    shapes: deque[tuple[int, int] | None] = field(
        default_factory=lambda: deque(maxlen=FIT_WINDOW))
    count: int = 0  # steps ever recorded

    def recent(self) -> list[tuple[int, float, float]]:
        return list(islice(self.steps, max(0, len(self.steps) - COST_WINDOW), None))

    def by_shape(self) -> list[list[tuple[int, float, float]]]:
        """The steps by shape, for the context fit: within one shape only the contexts
        differ. Across shapes a bucket mixed a batch's last steps (few sequences, long
        contexts, the host busy with the requests that ended) with steady steps of as many
        rows; and start-up calibration (short contexts, an idle host) with live steps of its
        shape: on the H100 the slope read 1.6e-7 s per KV token where steady runs of 32 and 128
        sequences each measured 4e-8 (Llama 8B's 128 KiB of KV a token at 3.35 TB/s is
        3.9e-8), and the curve's rows term collapsed under it. Calibration steps are left out
        (`StepCostModel.fit_context`)."""
        groups: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
        for step, shape in zip(self.steps, self.shapes, strict=True):
            if shape is not None:
                groups.setdefault(shape, []).append(step)
        return list(groups.values())


class _Curve:
    """One kind of step's buckets (plain or verify) and its fitted points at no context."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        # Seconds per KV token read (context_slope over this kind's steps), 0 until measured.
        self.per_kv_token = 0.0
        # The fitted points and the slope they were fitted with, until the next step.
        self._base: tuple[float, list[tuple[float, float]]] | None = None

    def refit_slope(self) -> None:
        self.per_kv_token = context_slope([g for b in self.buckets.values()
                                           for g in b.by_shape()])

    def record(self, rows: int, kv_tokens: float, seconds: float,
               shape: tuple[int, int] | None = None) -> None:
        b = self.buckets.setdefault(round(2 * math.log2(rows)), _Bucket())
        b.steps.append((rows, kv_tokens, seconds))
        b.shapes.append(shape)
        b.count += 1
        self._base = None

    def base(self, per_kv_token: float) -> list[tuple[float, float]]:
        """(rows, seconds at no context) per bucket, ascending in both: a step with more rows
        costs no less than one with fewer, so the buckets' medians are fitted to a
        non-decreasing curve (`monotone`). Without the fit a bucket that saw few steps, one of
        them slow (the machine busy, a shape's first use), could read dearer than the buckets
        above it: on a shared 2-core machine 2 and 3 rows read 119 and 151 ms against 94 ms for
        4 rows, and the policy judged one draft dearer than four."""
        if self._base is None or self._base[0] != per_kv_token:
            rows: list[float] = []
            medians: list[float] = []
            weights: list[float] = []
            for _, b in sorted(self.buckets.items()):
                recent = b.recent()
                rows.append(sum(r for r, _, _ in recent) / len(recent))
                medians.append(statistics.median(
                    max(s - per_kv_token * k, (1.0 - MAX_CONTEXT_SHARE) * s)
                    for _, k, s in recent))
                weights.append(min(b.count, MAX_WEIGHT))
            self._base = per_kv_token, list(zip(rows, monotone(medians, weights), strict=True))
        return self._base[1]


class StepCostModel:
    """Plain steps and verify steps (any sequence verifies drafts) on curves of their own: a
    verify step also runs the rejection sampler and, its tokens needed on the host before the
    next step's drafts, does not overlap the next step's launch. On the H100 one curve for both
    read 12-15 ms for plain steps of 8-64 sequences that took 6.5-9.5 ms, and the policy drafted
    where plain decoding was faster (bench/results/h100/spec_step_trace/). Each has its own
    cost per KV token too: a verify step's grows with the drafting the host does between steps
    (an n-gram lookup reads the whole context), which an overlapped plain step hides; one slope
    for both read 1.2-1.8e-6 s per KV token from 16-sequence verify steps on an H100 and priced
    plain steps at two to three times their time (bench/results/h100/spec_policy_1205/)."""

    def __init__(self) -> None:
        self.plain = _Curve()
        self.verify = _Curve()
        self._recorded = 0
        # Recent steps' mean context per sequence (the gateway's request joins with about it).
        self.context_per_sequence = 0.0
        # The curves at one batch's context, until the next step: the budget asks for them for
        # each (method, class) and each pause floor every round, at the same context.
        self._cost: tuple[tuple[float, float, float, tuple[int, int]], StepCost] | None = None
        # (rows per sequence, sequences at most) of the verify steps a verify CUDA graph pads
        # (StepCost.verify_pad_rows): set by the engine where the runner captured them.
        self.verify_pad: tuple[int, int] = (0, 0)
        # Whether steps recorded now join the context fit (calibration's do not: _Bucket.by_shape).
        self.fit_context = True

    def record(self, rows: int, seconds: float, kv_tokens: float = 0.0, sequences: int = 0,
               verify: bool = False) -> None:
        """One decode step of `rows` query rows over `sequences` sequences whose contexts sum
        to `kv_tokens` took `seconds`; `verify`: a sequence in it verified drafts."""
        if rows <= 0 or seconds <= 0:
            return
        shape = (rows, sequences) if self.fit_context else None
        (self.verify if verify else self.plain).record(rows, max(0.0, kv_tokens), seconds,
                                                       shape)
        self._cost = None
        self._recorded += 1
        if sequences > 0:
            per_seq = kv_tokens / sequences
            self.context_per_sequence = (per_seq if self._recorded == 1 else
                                         self.context_per_sequence
                                         + CONTEXT_SMOOTHING * (per_seq - self.context_per_sequence))
        if self._recorded % REFIT_EVERY == 0:
            self.plain.refit_slope()
            self.verify.refit_slope()

    @property
    def per_kv_token(self) -> float:
        """Plain steps' seconds per KV token (`verify_per_kv_token`: verify steps')."""
        return self.plain.per_kv_token

    @per_kv_token.setter
    def per_kv_token(self, seconds: float) -> None:
        """Both curves' (as if fitted so)."""
        self.plain.per_kv_token = self.verify.per_kv_token = seconds

    @property
    def verify_per_kv_token(self) -> float:
        return self.verify.per_kv_token

    def points(self, kv_tokens: float = 0.0, verify: bool = False) -> list[tuple[float, float]]:
        """(rows, seconds) per bucket of plain (or verify) steps, for a batch whose contexts
        sum to `kv_tokens`."""
        curve = self.verify if verify else self.plain
        extra = curve.per_kv_token * max(0.0, kv_tokens)
        return [(r, s + extra) for r, s in curve.base(curve.per_kv_token)]

    def cost(self, kv_tokens: float = 0.0) -> StepCost:
        """Both curves, for a batch whose contexts sum to `kv_tokens`."""
        key = (kv_tokens, self.plain.per_kv_token, self.verify.per_kv_token, self.verify_pad)
        if self._cost is None or self._cost[0] != key:
            self._cost = key, StepCost.of(self.points(kv_tokens),
                                          self.points(kv_tokens, verify=True), self.verify_pad)
        return self._cost[1]

    def __len__(self) -> int:
        return len(self.plain.buckets) + len(self.verify.buckets)
