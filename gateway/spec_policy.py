"""The speculative decoding policy: which proposer, and how many drafts per step, to ask of a
decode worker for one request (docs/architecture.md, "A request's way through the layers").

Each draft is one more query row per sequence in the worker's verify step, and the whole batch
waits for the step. On a lightly loaded worker a step is bound by streaming the weights: the
extra rows are nearly free, and every accepted draft is a token without a step of its own. As
the batch grows the step turns compute-bound and rejected drafts slow every request in it.
Where the line lies depends on the hardware, the model and the text, so the policy reads it
from the worker ("adaptive", the default):

- the worker's measured step cost by query rows (`LoadReport.spec_step_cost`: start-up
  calibration, then live steps) and its smoothed acceptance per proposer and request class
  (`LoadReport.spec_acceptance`);
- for the worker's batch with this request in it (its load + 1), every proposer the worker
  has and every cap k: the batch's tokens per second if this request speculates so
  (engine_api/spec_gain.py), and plain decoding's with the margin speculation must beat
  (MIN_GAIN: its costs the model leaves out). The best batch rate wins; choices within
  TIE_BAND of it are a tie, won by the request's own rate (its tokens per step over the
  step's time: its TPOT; plain decoding's with the same margin).
  The batch's other sequences that this gateway sent are counted as decided (their expected
  tokens and rows per step, held from decision to the call's end); those it cannot see
  (other gateways') are assumed to choose as this one;
- hysteresis per worker and class (HOLD_GAIN): the method a class speculates with is kept
  until another is predicted clearly better, and speculation, once on, stops only at a
  predicted loss (it starts at MIN_GAIN), so measurement noise does not flip a class's
  requests between near-equal choices;
- off for the load seen now is left to the worker where it budgets each step's drafts
  (`LoadReport.spec_step_budget`) and a proposer pays for the class on a light worker: sent
  with that proposer and the full cap (reason "budget"), the request drafts once its batch
  thins, where one sent off never would (and the load seen may be a poll old). Not under an
  SLO, which the worker's budget does not know;
- the SLO guard (`speculative_tpot_slo_ms`): no choice whose predicted step exceeds the target
  unless a plain step already does;
- the cap sent is not the k predicted best for the batch seen now but the most the SLO guard
  allows (all of `speculative_tokens` without one): the batch changes after admission, and the
  worker lowers each step's drafts to what pays for the batch as it is then (its step budget,
  from the same numbers). A cap fixed at admission would hold a request at few drafts for its
  whole life after one crowded moment;
- a proposer with no numbers yet is tried (a fresh worker learns from its first requests). The
  worker measures n-gram lookup and suffix decoding on a sample of its requests whatever they
  were sent with (shadow drafts, engine/spec/shadow.py), so their numbers stay fresh without
  exploring; a draft model that lost is tried again every EXPLORE_EVERY-th decision for a
  worker and class.

The request's class is what the gateway can see of it: "tools" (it sent tools), "code" (its
prompt holds code), "repetitive" (its prompt repeats itself), else "text".

A worker that has not reported measurements (or with `speculative_policy` "threshold") gets
the load threshold: `speculative_tokens` drafts below `speculative_max_load` pending requests,
none beyond; a draft model below `speculative_draft_max_load`, else n-gram lookup. "always"
asks for `speculative_tokens` drafts every step whatever the load, fixed (DecodeRequest.
speculative_fixed: the worker's step budget does not lower them; benchmarks' always-on
baselines).

The worker still has the last word: it caps the request's drafts at its own
`--num-speculative-tokens`, may lower them per step as its batch changes (its step budget,
from the same numbers), pauses a request whose drafts keep failing, and without a speculative
method ignores them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from engine_api.spec_gain import (
    SHADOWED_METHODS,
    Acceptance,
    StepCost,
    choices,
    rate_without,
    required_rate,
    step_seconds,
)
from gateway.config import GatewayConfig
from gateway.router import Worker
from protos.splitserve.v1 import common_pb2

_LABELS: dict[int, str] = {common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL: "draft_model",
                           common_pb2.SPECULATIVE_METHOD_NGRAM: "ngram",
                           common_pb2.SPECULATIVE_METHOD_SUFFIX: "suffix",
                           common_pb2.SPECULATIVE_METHOD_UNSPECIFIED: "default"}
_BY_NAME = {name: value for value, name in _LABELS.items() if name != "default"}
Method: TypeAlias = common_pb2.SpeculativeMethod.ValueType

# Measured steps (decayed) a (method, class) needs before its numbers decide.
MIN_MEASURED_STEPS = 16.0
# Every this many decisions for a worker and class, a losing proposer is tried again (an
# unmeasured one every time). Rarely: an explored request runs slower than the best choice
# would (measured on the CPU: at 8, one explored request in a cell of 4 cost it ~15%).
EXPLORE_EVERY = 32
# Speculation must beat plain decoding by this much (the model leaves out a lost async overlap
# and the noise in the measurements).
MIN_GAIN = 1.1
# A (worker, class) keeps what it chose last (hysteresis): the method it speculates with adds
# this factor to what the request adds to the batch's rate, and plain decoding loses its
# MIN_GAIN margin while it speculates. So speculation starts at a predicted gain of MIN_GAIN,
# stops only at a predicted loss of ~10%, and another method must be predicted ~10% better to
# take over. Without it the near ties between methods and around plain decoding that a noisy
# measurement makes (CPU: suffix and n-gram within a few percent on code edits) flipped
# requests of one class back and forth, and each flip to the worse choice cost its request.
HOLD_GAIN = 1.1
# Choices (method, k) whose predicted batch rates are this close (fraction of the best) are a
# tie, which the request's own rate breaks.
TIE_BAND = 0.05
# A prompt whose 4-token windows recur at least this often is "repetitive" (code, edits, data).
REPETITIVE_SHARE = 0.25
_CLASS_WINDOW = 4
_CLASS_MAX_TOKENS = 4096
# Lines that read as code (a keyword first, or ending in a brace or semicolon): this many make
# a prompt "code".
CODE_LINES = 3
_CODE_LINE = re.compile(
    r"^[ \t]*(?:def |class |return\b|import |from \S+ import|for |while |if |elif |else:|"
    r"function |const |let |var |#include|public |private |fn |func )|[{};][ \t]*$",
    re.MULTILINE)


@dataclass(frozen=True, slots=True)
class SpecDecision:
    """What the policy chose for one Decode call, and what it saw."""

    num_speculative_tokens: int   # DecodeRequest.num_speculative_tokens (0: off)
    load: int                     # requests pending on the worker besides this one
    method: Method = common_pb2.SPECULATIVE_METHOD_UNSPECIFIED  # DecodeRequest.speculative_method
    request_class: str = ""       # DecodeRequest.speculative_class
    reason: str = "threshold"     # measured, explore, budget, threshold, always, off
    predicted_gain: float = 1.0   # the batch's predicted tokens/s over plain decoding's
    step_seconds: float = 0.0     # the predicted step time (0: not measured)
    accepted_per_step: float = 0.0  # the drafts the method is expected to land per step
    rows_per_step: float = 1.0    # the query rows it is expected to add to each step
    predicted_k: int = 0          # the drafts per step predicted best for the batch seen now

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def label(self) -> str:
        """The metrics label: "off", or the proposer asked for ("default": the worker's own)."""
        return _LABELS.get(int(self.method), "default") if self.enabled else "off"


def speculative_tokens_for_load(load: int, speculative_tokens: int, max_load: int) -> int:
    """`speculative_tokens` while `load` (pending requests on the worker) is below `max_load`,
    0 at or above it."""
    return speculative_tokens if load < max_load else 0


def worker_load(worker: Worker) -> int:
    """Requests pending on a decode worker besides the one being routed (`Worker.routing_key`:
    this gateway's in flight there plus the others of its last load report). `WorkerPool.pick`
    has already counted the request being routed (in `in_flight`), so it is taken off again."""
    pending, _ = worker.routing_key()
    return max(0, pending - 1)


def method_for_load(load: int, methods: Sequence[Method], draft_max_load: int) -> Method:
    """The threshold rule's proposer: the draft model below `draft_max_load` if the worker has
    one, else n-gram lookup if it has it, else UNSPECIFIED (the worker's own; `methods` empty:
    it has not reported any, or has none and ignores the request's drafts anyway)."""
    if load < draft_max_load and common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL in methods:
        return common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL
    if common_pb2.SPECULATIVE_METHOD_NGRAM in methods:
        return common_pb2.SPECULATIVE_METHOD_NGRAM
    return common_pb2.SPECULATIVE_METHOD_UNSPECIFIED


def request_class(prompt_token_ids: Sequence[int], has_tools: bool = False,
                  text: str = "") -> str:
    """The request's class for acceptance statistics: "tools" (it sent tools), "code" (its
    prompt's text, when given, holds a code fence or CODE_LINES lines that read as code),
    "repetitive" (a fourth or more of the prompt's 4-token windows occurred earlier in it:
    structured data, logs, edits) or "text". Reads the prompt's last _CLASS_MAX_TOKENS tokens."""
    if has_tools:
        return "tools"
    if text and ("```" in text or len(_CODE_LINE.findall(text)) >= CODE_LINES):
        return "code"
    ids = prompt_token_ids[-_CLASS_MAX_TOKENS:]
    windows = len(ids) - _CLASS_WINDOW + 1
    if windows < 8:
        return "text"
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(windows):
        w = tuple(ids[i:i + _CLASS_WINDOW])
        repeats += w in seen
        seen.add(w)
    return "repetitive" if repeats >= REPETITIVE_SHARE * windows else "text"


def _acceptance(report: common_pb2.LoadReport, method: Method, cls: str) -> Acceptance | None:
    """The worker's acceptance for (method, class); pooled over its classes when the class
    itself is not yet measured enough; None when neither is."""
    pooled_steps = 0.0
    pooled_drafted: list[float] = []
    pooled_accepted: list[float] = []
    for a in report.spec_acceptance:
        if a.method != method:
            continue
        if a.request_class == cls and a.steps >= MIN_MEASURED_STEPS:
            return Acceptance(a.steps, tuple(a.drafted), tuple(a.accepted))
        pooled_steps += a.steps
        for acc, vals in ((pooled_drafted, a.drafted), (pooled_accepted, a.accepted)):
            acc.extend([0.0] * (len(vals) - len(acc)))
            for i, v in enumerate(vals):
                acc[i] += v
    if pooled_steps < MIN_MEASURED_STEPS:
        return None
    return Acceptance(pooled_steps, tuple(pooled_drafted), tuple(pooled_accepted))


def _slo_cap(cost: StepCost, acceptance: Acceptance, batch: int, cap: int, slo_s: float,
             known: tuple[int, float, float], k: int) -> int:
    """The most drafts in [k, cap] whose predicted step meets the SLO (`cap` without one, or
    where a plain step already misses it)."""
    if slo_s <= 0 or step_seconds(cost, batch, known) > slo_s:
        return cap
    for send in range(cap, k, -1):
        _, rows = acceptance.tokens_and_rows(send)
        if step_seconds(cost, batch, known, rows, verify=True) <= slo_s:
            return send
    return k


class SpecPolicy:
    """The policy of one gateway: `decide` per Decode call. Keeps only its exploration
    counters (per worker and class); everything else is in the workers' load reports."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._decisions: dict[tuple[str, str], int] = {}
        # Per (worker, class), the label of the last measured choice ("off" or a method).
        self._incumbent: dict[tuple[str, str], str] = {}
        # Per worker, this gateway's calls in flight there: (count, expected tokens per step,
        # expected rows per step), summed; `decide` adds, `release` takes away.
        self._held: dict[str, tuple[int, float, float]] = {}

    def release(self, address: str, decision: SpecDecision) -> None:
        """The Decode call `decision` was made for has ended (however it ended)."""
        n, t, r = self._held.get(address, (0, 0.0, 0.0))
        if n <= 1:
            self._held.pop(address, None)
            return
        self._held[address] = (n - 1, t - 1.0 - decision.accepted_per_step,
                               r - decision.rows_per_step)

    def decide(self, worker: Worker, cls: str = "") -> SpecDecision:
        """The choice for a Decode call of class `cls` on `worker`, which `WorkerPool.pick`
        just chose (its load counts this request); held as in flight there until `release`."""
        decision = self._decide(worker, cls)
        n, t, r = self._held.get(worker.address, (0, 0.0, 0.0))
        self._held[worker.address] = (n + 1, t + 1.0 + decision.accepted_per_step,
                                      r + decision.rows_per_step)
        return decision

    def _decide(self, worker: Worker, cls: str) -> SpecDecision:
        config = self.config
        load = worker_load(worker)
        report = worker.load
        cap = config.speculative_tokens
        if report.max_speculative_tokens:
            cap = min(cap, report.max_speculative_tokens)
        methods = self._methods(report)
        if cap <= 0 or (report.max_speculative_tokens and not methods):
            return SpecDecision(0, load, request_class=cls, reason="off")
        if config.speculative_policy == "always":
            method = methods[0] if methods else common_pb2.SPECULATIVE_METHOD_UNSPECIFIED
            return SpecDecision(cap, load, method, cls, "always", rows_per_step=1.0 + cap)
        cost = StepCost.of([(p.rows, p.seconds) for p in report.spec_step_cost if not p.verify],
                           [(p.rows, p.seconds) for p in report.spec_step_cost if p.verify],
                           (report.spec_verify_pad_rows, report.spec_verify_pad_max_seqs))
        if config.speculative_policy == "threshold" or not cost or not methods:
            return self._threshold(load, methods, cls)
        return self._adaptive(worker.address, report, cost, load, cap, methods, cls)

    def _methods(self, report: common_pb2.LoadReport) -> list[Method]:
        """The worker's proposers the policy may ask for (its own first)."""
        methods = list(report.speculative_methods)
        wanted = self.config.speculative_policy_method
        if wanted != "auto":
            methods = [m for m in methods if m == _BY_NAME[wanted]]
        return methods

    def _threshold(self, load: int, methods: list[Method], cls: str) -> SpecDecision:
        config = self.config
        if self.config.speculative_policy_method != "auto" and methods:
            method = methods[0]
        else:
            method = method_for_load(load, methods, config.speculative_draft_max_load)
        tokens = speculative_tokens_for_load(load, config.speculative_tokens,
                                             config.speculative_max_load)
        if not tokens:
            return SpecDecision(0, load, request_class=cls)
        return SpecDecision(tokens, load, method, cls, rows_per_step=1.0 + tokens)

    def _adaptive(self, address: str, report: common_pb2.LoadReport, cost: StepCost,
                  load: int, cap: int, methods: list[Method], cls: str) -> SpecDecision:
        slo_s = self.config.speculative_tpot_slo_ms / 1e3
        known = self._known(address, load)
        key = (address, cls)
        incumbent = self._incumbent.get(key, "off")
        best, measured, unmeasured = self._best(report, cost, load, load + 1, known, cap,
                                                methods, cls, slo_s, incumbent)
        n = self._decisions[key] = self._decisions.get(key, 0) + 1
        # Try an unmeasured proposer (every decision until it has numbers: a fresh worker
        # learns from its first requests), and now and then one that lost, unless the worker
        # measures it on requests that do not use it (shadow drafts: n-gram, suffix).
        losers = [m for m in measured if not (best.enabled and m == best.method)
                  and _LABELS.get(int(m)) not in SHADOWED_METHODS]
        pool = unmeasured or (losers if n % EXPLORE_EVERY == 0 else [])
        if pool:
            step_s = step_seconds(cost, load + 1, known, 1 + cap, verify=True)
            if not slo_s or step_s <= slo_s or step_seconds(cost, load + 1, known) > slo_s:
                return SpecDecision(cap, load, pool[n % len(pool)], cls, "explore", 1.0, step_s,
                                    rows_per_step=1.0 + cap)
        self._incumbent[key] = best.label
        if best.enabled or not report.spec_step_budget or slo_s:
            return best
        # Off for the load seen now. A worker that budgets each step's drafts holds a
        # speculating request at none while they do not pay for its batch, and lets it draft
        # once the batch thins; a request sent off never drafts. So where a method pays for
        # this class on a light worker, it is sent with the full cap and the worker's budget
        # has the "not now" (not under an SLO: the budget does not know the target). The
        # load seen may also be an old report's: a burst of other gateways' requests that
        # ended since the last poll still counts for up to a poll interval.
        light, _, _ = self._best(report, cost, load, 1, (0, 0, 0.0), cap, methods, cls, 0.0,
                                 incumbent)
        if not light.enabled:
            return best
        return SpecDecision(cap, load, light.method, cls, "budget", 1.0, best.step_seconds,
                            predicted_k=0)

    def _best(self, report: common_pb2.LoadReport, cost: StepCost, load: int, batch: int,
              known: tuple[int, float, float], cap: int, methods: list[Method], cls: str,
              slo_s: float, incumbent: str) -> tuple[SpecDecision, list[Method], list[Method]]:
        """The best choice for a batch of `batch` with `known` decided in it; and the methods
        measured for the class, and those not."""
        plain_s = step_seconds(cost, batch, known)
        best = SpecDecision(0, load, request_class=cls, reason="measured", step_seconds=plain_s)
        unmeasured: list[Method] = []
        measured: list[Method] = []
        base = rate_without(cost, batch, known)
        # (batch tokens/s, the request's own tokens/s, decision) of each choice: plain
        # decoding with the margin speculation must beat on both counts (its costs the model
        # leaves out: MIN_GAIN; none while the class speculates: HOLD_GAIN), and every
        # (method, k) that beats plain.
        margin = MIN_GAIN if incumbent == "off" else 1.0
        _, needed = required_rate(cost, batch, margin, known)
        winners: list[tuple[float, float, SpecDecision]] = [
            (needed, margin / plain_s if plain_s > 0 else 0.0, best)]
        for method in methods:
            acceptance = _acceptance(report, method, cls)
            if acceptance is None:
                unmeasured.append(method)
                continue
            measured.append(method)
            _, better = choices(cost, acceptance, batch, cap, slo_s, 1.0, known)
            for choice in better:
                tokens, rows = acceptance.tokens_and_rows(choice.k)
                send = _slo_cap(cost, acceptance, batch, cap, slo_s, known, choice.k)
                hold = HOLD_GAIN if _LABELS.get(int(method)) == incumbent else 1.0
                winners.append((base + hold * (choice.batch_tokens_per_s - base),
                                hold * tokens / choice.step_seconds,
                                SpecDecision(send, load, method, cls, "measured", choice.gain,
                                             choice.step_seconds, tokens - 1.0, rows,
                                             choice.k)))
        # The batch's rate decides; between choices within TIE_BAND of the best, the
        # request's own rate (its TPOT) does. On a batch that is already large the marginal
        # request barely moves the batch's rate whatever it does (at 15 others verifying:
        # off, n-gram and suffix within ~2% of each other), so measurement noise alone would
        # pick; the request itself is 20-40% faster with the choice that lands more tokens
        # per step, and a batch that starts together ends with its slowest request.
        top = max(w[0] for w in winners)
        best = max((w for w in winners if w[0] >= top * (1.0 - TIE_BAND)),
                   key=lambda w: w[1])[2]
        return best, measured, unmeasured

    def _known(self, address: str, load: int) -> tuple[int, float, float]:
        """(sequences, tokens per step, rows per step) of the worker's `load` others whose
        choice this gateway made (its calls in flight there, at most `load` of them)."""
        n, t, r = self._held.get(address, (0, 0.0, 0.0))
        if n <= 0 or load <= 0:
            return 0, 0.0, 0.0
        if n <= load:
            return n, t, r
        return load, t * load / n, r * load / n


def decide(worker: Worker, config: GatewayConfig, cls: str = "") -> SpecDecision:
    """The policy's choice for a Decode call on `worker` without exploration memory (a fresh
    `SpecPolicy`); the orchestrator keeps one `SpecPolicy` for its lifetime."""
    return SpecPolicy(config).decide(worker, cls)
