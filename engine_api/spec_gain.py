"""The speculative decoding trade, in numbers both sides use: the gateway's per-request policy
(gateway/spec_policy.py) and a decode worker's per-step cap (engine/spec/budget.py).

A decode step's time is a function of its query rows, measured apart for plain and verify steps
(`StepCost`: by the worker, at start-up and from live steps); a speculating sequence adds one
row per draft. A method's
acceptance (`Acceptance`) says, per draft position i, how often a step drafted at position i
and how often that draft was accepted, per step of a speculating request. With a cap of k
drafts a sequence then emits `1 + sum(accepted[:k])` tokens per step from `1 + sum(drafted[:k])`
rows. The batch pays for every row: the best k maximises the batch's tokens per second.

Torch-free (the gateway imports it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# The proposers a worker measures on requests that do not verify their drafts (shadow drafts,
# engine/spec/shadow.py): a lookup between steps, no model. Their numbers stay fresh without
# exploring with real requests.
SHADOWED_METHODS = frozenset({"ngram", "suffix"})


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], rows: float) -> float:
    """Measured points, linear in between and beyond the last two (a step's time grows about
    linearly in rows once compute-bound); 0.0 when nothing was measured."""
    if not xs:
        return 0.0
    if rows <= xs[0]:
        # Below the smallest measurement a step costs no less than it: the weights are read
        # once per step whatever the rows.
        return ys[0]
    if len(xs) == 1:
        return ys[0] * rows / xs[0]  # one point: assume compute-bound (the cautious side)
    i = min(bisect.bisect_left(xs, rows), len(xs) - 1)  # the segment [i-1, i], or the last
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    return y0 + slope * (rows - x0)


def _curve(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(rows, seconds) ascending in rows, equal rows averaged, rows <= 0 or seconds <= 0 dropped."""
    merged: dict[float, list[float]] = {}
    for r, s in points:
        if r > 0 and s > 0:
            merged.setdefault(r, []).append(s)
    xs = sorted(merged)
    return tuple(xs), tuple(sum(merged[x]) / len(merged[x]) for x in xs)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds per decode step by its query rows, for plain steps and for verify steps (any
    sequence in the step verifies drafts): measured points, linear in between and beyond the
    last two. The two differ by more than their rows: a verify step runs the rejection sampler,
    and its tokens must reach the host before the next step's drafts, so it does not overlap
    the next step's launch as a plain step does."""

    rows: tuple[float, ...]      # ascending
    seconds: tuple[float, ...]
    verify_rows: tuple[float, ...] = ()
    verify_seconds: tuple[float, ...] = ()
    # A verify step of up to `verify_pad_max_seqs` sequences replays a verify CUDA graph that
    # computes `verify_pad_rows` rows for every sequence, whatever it drafted (0: none).
    verify_pad_rows: int = 0
    verify_pad_max_seqs: int = 0

    @classmethod
    def of(cls, points: Sequence[tuple[float, float]],
           verify_points: Sequence[tuple[float, float]] = (),
           verify_pad: tuple[int, int] = (0, 0)) -> StepCost:
        """From (rows, seconds) points in any order (rows <= 0 or seconds <= 0 dropped);
        `verify_pad`: (verify_pad_rows, verify_pad_max_seqs)."""
        return cls(*_curve(points), *_curve(verify_points), *verify_pad)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def seconds_at(self, rows: float, verify: bool = False, sequences: int = 0) -> float:
        """The step time at `rows` query rows (0.0 when nothing was measured); `verify`: of a
        verify step, from its own points where any were measured. Not bounded below by a
        plain step's: a verifying sequence's rows share one sequence's KV, and on the CPU
        verify steps of 130 rows took 390-430 ms where plain steps, extrapolated from 32 rows,
        read 555 (bench/results/cpu_spec_budget_trace/). `sequences` (> 0): the step's, so that
        a verify step the verify graph runs is priced at the rows it computes; fewer drafts
        than the graph's then cost the same (on the H100 a verify step of 64 sequences took
        17.2-17.7 ms with 1 to 4 drafts each), and a policy that priced the drafts asked took
        fewer for nothing."""
        if verify and 0 < sequences <= self.verify_pad_max_seqs:
            rows = max(rows, float(sequences * self.verify_pad_rows))
        if verify and self.verify_rows:
            return _interpolate(self.verify_rows, self.verify_seconds, rows)
        return _interpolate(self.rows, self.seconds, rows)


@dataclass(frozen=True, slots=True)
class Acceptance:
    """A method's smoothed outcome per step of a speculating request: `drafted[i]` and
    `accepted[i]` are the steps that drafted (and accepted) a draft at position i, `steps` the
    steps in all (the same decayed weights)."""

    steps: float
    drafted: tuple[float, ...]
    accepted: tuple[float, ...]

    def tokens_and_rows(self, k: int) -> tuple[float, float]:
        """(tokens emitted, query rows) per step with at most k drafts."""
        if self.steps <= 0 or k <= 0:
            return 1.0, 1.0
        k = min(k, len(self.drafted), len(self.accepted))
        return (1.0 + sum(self.accepted[:k]) / self.steps,
                1.0 + sum(self.drafted[:k]) / self.steps)


@dataclass(frozen=True, slots=True)
class Choice:
    """The best cap for a batch: `k` drafts (0: off), the tokens per second it predicts for
    the batch, and the plain batch's, and the step time it predicts."""

    k: int
    batch_tokens_per_s: float
    plain_tokens_per_s: float
    step_seconds: float

    @property
    def gain(self) -> float:
        """Predicted speed-up of the batch over plain decoding (1.0: none)."""
        return (self.batch_tokens_per_s / self.plain_tokens_per_s
                if self.plain_tokens_per_s > 0 else 1.0)


def step_seconds(cost: StepCost, batch: int, known: tuple[int, float, float] = (0, 0.0, 0.0),
                 rows_per_seq: float = 1.0, verify: bool | None = None) -> float:
    """The predicted step of a batch of `batch` sequences: `known` (sequences, tokens and rows
    per step) decided, the others at `rows_per_seq` rows each. A verify step where `verify`
    says so; by default where the others draft or the known ones verify."""
    batch = max(1, batch)
    alike = batch - min(known[0], batch - 1)
    if verify is None:
        verify = rows_per_seq > 1.0 or verifies(known)
    return cost.seconds_at(known[2] + alike * rows_per_seq, verify, batch)


def required_rate(cost: StepCost, batch: int, min_gain: float = 1.0,
                  known: tuple[int, float, float] = (0, 0.0, 0.0)) -> tuple[Choice, float]:
    """Plain decoding's `Choice` for the batch (as `choices`), and the batch rate speculation
    must reach to be worth it: plain's plus (`min_gain` - 1) of what this request adds to it
    (of the whole batch's rate when nothing is known)."""
    batch = max(1, batch)
    n_known, t_known, _ = known
    alike = batch - min(n_known, batch - 1)
    plain_s = step_seconds(cost, batch, known)
    plain_rate = (t_known + alike) / plain_s if plain_s > 0 else 0.0
    without = rate_without(cost, batch, known)
    needed = plain_rate + (min_gain - 1.0) * max(0.0, plain_rate - without)
    return Choice(0, plain_rate, plain_rate, plain_s), needed


def rate_without(cost: StepCost, batch: int,
                 known: tuple[int, float, float] = (0, 0.0, 0.0)) -> float:
    """The batch's tokens per second without this request and the unknown ones: the known
    sequences' alone (0 when none is known). A choice's rate less this is what the request
    (and those assumed to choose alike) adds to the batch."""
    n_known, t_known, r_known = known
    if min(n_known, max(1, batch) - 1) <= 0 or r_known <= 0:
        return 0.0
    seconds = cost.seconds_at(r_known, verifies(known), n_known)
    return t_known / seconds if seconds > 0 else 0.0


def verifies(known: tuple[int, float, float]) -> bool:
    """Whether the known sequences' steps verify drafts (more rows than sequences): then the
    batch's step is a verify step whatever the others choose."""
    return known[2] > known[0] + 1e-9


def choices(cost: StepCost, acceptance: Acceptance, batch: int, max_k: int,
            max_step_seconds: float = 0.0, min_gain: float = 1.0,
            known: tuple[int, float, float] = (0, 0.0, 0.0)) -> tuple[Choice, list[Choice]]:
    """Plain decoding's `Choice` (k 0) for the batch, and every cap in [1, max_k] that beats it
    within the limits below (the batch pays for every verify row).

    `known`: (sequences, tokens per step, rows per step) of the batch's sequences whose choice
    is already made (a gateway's own requests in flight there); the batch's other `batch` -
    sequences are assumed to speculate as this one would (the worker's per-step budget caps
    all of a class alike, and a gateway cannot see other gateways' choices).

    `max_step_seconds` (> 0): the SLO guard, no cap whose step would take longer, unless the
    plain step already does. `min_gain`: speculation must beat plain by this factor of what
    this request adds to the batch's rate (it has costs the model leaves out: the drafting
    itself, a lost async overlap); with nothing known, of the whole batch's."""
    batch = max(1, batch)
    n_known, t_known, _ = known
    alike = batch - min(n_known, batch - 1)  # this request and the unknown ones
    plain, needed = required_rate(cost, batch, min_gain, known)
    plain_rate, plain_s = plain.batch_tokens_per_s, plain.step_seconds
    if not cost or max_k <= 0:
        return plain, []
    out: list[Choice] = []
    for k in range(1, max_k + 1):
        tokens, rows = acceptance.tokens_and_rows(k)
        step_s = step_seconds(cost, batch, known, rows, verify=True)
        if step_s <= 0:
            continue
        if max_step_seconds > 0 and step_s > max_step_seconds >= plain_s:
            continue
        rate = (t_known + alike * tokens) / step_s
        if rate > plain_rate and rate >= needed:
            out.append(Choice(k, rate, plain_rate, step_s))
    return plain, out


def best_k(cost: StepCost, acceptance: Acceptance, batch: int, max_k: int,
           max_step_seconds: float = 0.0, min_gain: float = 1.0,
           known: tuple[int, float, float] = (0, 0.0, 0.0)) -> Choice:
    """The cap in [0, max_k] that maximises the batch's tokens per second (`choices`' best;
    plain decoding's when none beats it)."""
    plain, better = choices(cost, acceptance, batch, max_k, max_step_seconds, min_gain, known)
    best = plain
    for c in better:
        if c.batch_tokens_per_s > best.batch_tokens_per_s:
            best = c
    return best
