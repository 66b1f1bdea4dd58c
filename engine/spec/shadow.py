"""Shadow drafts: the acceptance of the cheap proposers (n-gram lookup, suffix decoding),
measured on requests that do not verify their drafts, so that the numbers the step budget and
the gateway decide from stay fresh and exist for every method.

Acceptance was measured only where drafts were verified. The step budget (budget.py) holds a
(method, class) at no drafts where its numbers say drafting does not pay, and the gateway sends
a request with one method or none: numbers taken while the text was hard to draft for then held
drafting off long after the text changed (only an exploring request now and then measured
again), a method not chosen was measured only by exploring with real requests, and the same
workload ran with or without speculation depending on what came before it.

So a sample of the running requests (at most MAX_SAMPLED at a time, each kept until it ends, so
that a proposer's per-request state is built for few of them; at most MAX_PER_STEP proposals
per step, taking turns) is asked for drafts by every cheap proposer the worker has, except the one whose drafts it verifies this round: the request
speculates with another method, or the gateway sent it without drafts, or the budget holds it
at none. The drafts are not verified; they are scored against the tokens the request goes on to
produce. A draft at position i would have been accepted if it and every draft before it equal
the tokens sampled there: under greedy decoding that is exactly the verify step's outcome; under
sampling, the chance of that match is the chance a verify step accepts those drafts (the
target's probability of each drafted token in turn), so the counts are unbiased. Each scored
proposal is one step in the acceptance statistics (stats.py), as a verified one is, but not in
vLLM's counters of verified drafts; a proposal that finds no drafts is a step with none, as it
is for a speculating request. A request keeps at most one proposal per method pending; the next
is made once it is scored. A proposal whose tokens never came (the request ended) is dropped:
counting it short would bias the numbers.

Suffix decoding indexes a new request's text over a few rounds (suffix.py): a shadow proposal
waits until the request's tree holds all of it (asked again every round until then), since
drafts from part of the text would read the method low.

A draft model is not shadowed: running it for drafts nobody verifies costs a forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.spec.suffix import SuffixProposer
from engine_api.spec_gain import SHADOWED_METHODS

if TYPE_CHECKING:
    from engine.request import Request
    from engine.spec import Proposer
    from engine.spec.stats import AcceptanceStats

# Requests sampled at a time: enough numbers (each gives a proposal every few tokens per
# method) at a bounded host cost (a suffix tree per sampled request; a lookup per proposal).
MAX_SAMPLED = 8
# Proposals per engine step at most: the host's time between steps is the GPU's (async
# scheduling overlaps it with the device); an n-gram lookup over a long sequence costs ~0.1 ms.
MAX_PER_STEP = 4


@dataclass(frozen=True, slots=True)
class _Pending:
    request_class: str
    position: int          # the sequence's length when the drafts were proposed
    drafts: tuple[int, ...]
    asked: int             # the drafts asked for (positions beyond say nothing)


def matched_prefix(drafts: Sequence[int], actual: Sequence[int]) -> int:
    """How many leading drafts equal the tokens produced at their positions."""
    n = 0
    for d, t in zip(drafts, actual, strict=False):
        if d != t:
            break
        n += 1
    return n


def verifies(req: Request, method: str) -> bool:
    """Whether `req`'s steps verify drafts of `method` (and so are measured by them)."""
    return req.spec_method == method and req.num_speculative_tokens > 0 and req.spec_step_k != 0


class ShadowDrafts:
    """The sampled requests and their pending proposals, by request id and method."""

    def __init__(self, stats: AcceptanceStats, max_sampled: int = MAX_SAMPLED,
                 max_per_step: int = MAX_PER_STEP) -> None:
        self._stats = stats
        self.max_sampled = max_sampled
        self.max_per_step = max_per_step
        self._turn = 0
        self._sampled: dict[str, dict[str, _Pending]] = {}

    def __len__(self) -> int:
        """Pending proposals."""
        return sum(len(p) for p in self._sampled.values())

    @property
    def num_sampled(self) -> int:
        return len(self._sampled)

    def propose(self, reqs: Iterable[Request], proposers: Mapping[str, Proposer]) -> None:
        """New proposals for the sampled requests among `reqs` (running ones whose tokens just
        came; sampled first come, first served), per cheap method in `proposers`."""
        wanted: list[tuple[str, Request, int]] = []
        for req in reqs:
            if req.spec_shadow_k <= 0 or req.is_finished:
                continue  # its sampling cannot speculate (logprobs, a grammar, ...)
            pending = self._sampled.get(req.request_id)
            if pending is None:
                if len(self._sampled) >= self.max_sampled:
                    continue
                pending = self._sampled[req.request_id] = {}
            for method in proposers:
                if method in SHADOWED_METHODS and method not in pending \
                        and not verifies(req, method):
                    own = req.spec_method == method and req.num_speculative_tokens > 0
                    k = req.num_speculative_tokens if own else req.spec_shadow_k
                    wanted.append((method, req, k))
        if len(wanted) > self.max_per_step:  # a turn that moves, so that all get asked
            start = self._turn % len(wanted)
            self._turn += 1
            wanted = (wanted[start:] + wanted[:start])[:self.max_per_step]
        by_method: dict[str, list[tuple[Request, int]]] = {}
        for method, req, k in wanted:
            by_method.setdefault(method, []).append((req, k))
        for method, asked in by_method.items():
            drafts = _ask(proposers[method], asked)
            for (req, k), d in zip(asked, drafts, strict=True):
                if d is not None:  # None: not ready to measure yet (catching up)
                    self._add(req, method, d, k)

    def _add(self, req: Request, method: str, drafts: Sequence[int], k: int) -> None:
        if not drafts:  # a step with no drafts
            self._stats.record(method, req.spec_class, 0, 0, verified=False, allowed=k)
            return
        self._sampled[req.request_id][method] = _Pending(req.spec_class, req.num_tokens,
                                                         tuple(drafts), k)

    def score(self, req: Request) -> None:
        """Score `req`'s pending proposals whose positions all have their tokens now."""
        pending = self._sampled.get(req.request_id)
        if not pending:
            return
        for method, p in list(pending.items()):
            if req.num_tokens < p.position + len(p.drafts):
                continue
            del pending[method]
            actual = req.all_token_ids[p.position:p.position + len(p.drafts)]
            self._stats.record(method, p.request_class, len(p.drafts),
                               matched_prefix(p.drafts, actual), verified=False,
                               allowed=p.asked)

    def release(self, request_id: str) -> None:
        """The request ended: its proposals not yet scored are dropped, its slot freed."""
        self._sampled.pop(request_id, None)


def _ask(proposer: Proposer, asked: Sequence[tuple[Request, int]]) -> list[list[int] | None]:
    """`proposer`'s drafts for each (request, k); None where suffix decoding has not caught
    up with the request's text. A proposer drafts up to `draft_cap(req)`; for this call the
    cap is k and the budget's round cap is lifted, then both restored (the request's own
    drafts for its next step are not touched)."""
    saved = [(req.num_speculative_tokens, req.spec_step_k) for req, _ in asked]
    for req, k in asked:
        req.num_speculative_tokens, req.spec_step_k = k, -1
    reqs = [req for req, _ in asked]
    try:
        if isinstance(proposer, SuffixProposer):
            return proposer.propose_caught_up(reqs)
        return list(proposer.propose_batch(reqs))
    finally:
        for (req, _), (cap, step_k) in zip(asked, saved, strict=True):
            req.num_speculative_tokens, req.spec_step_k = cap, step_k
