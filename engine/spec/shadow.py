"""Shadow drafts: acceptance measured for the requests the worker's step budget holds at no
drafts, so that the numbers the budget and the gateway decide from stay fresh.

The budget (budget.py) caps a (method, class) at no drafts when its measured acceptance says
drafting does not pay for the batch. Without more, that acceptance would then only be measured
again by exploration (one request now and then): numbers taken while the text was hard to
draft for hold drafting off long after the text changed, and the same workload runs with or
without speculation depending on what came before it.

So a held request of a cheap proposer (n-gram lookup, suffix decoding: a lookup between steps,
no model) is still asked for drafts, at its own cap, and the drafts are not verified: they are
scored against the tokens the request goes on to produce. A draft at position i would have
been accepted if it and every draft before it equal the tokens sampled there: under greedy
decoding that is exactly the verify step's outcome; under sampling, the chance of that match is
the chance a verify step accepts those drafts (the target's probability of the drafted tokens,
one after the other), so the counts are unbiased. Each scored proposal is one step in the
acceptance statistics (stats.py), as a verified one is; a proposal that finds no drafts is a
step with none, as it is for a speculating request. A request keeps at most one proposal
pending; the next is made once it is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request
    from engine.spec import Proposer
    from engine.spec.stats import AcceptanceStats

# Proposers cheap enough to run for requests that do not speculate (no model).
SHADOW_METHODS = frozenset({"ngram", "suffix"})


@dataclass(frozen=True, slots=True)
class _Pending:
    method: str
    request_class: str
    position: int          # the sequence's length when the drafts were proposed
    drafts: tuple[int, ...]


def matched_prefix(drafts: Sequence[int], actual: Sequence[int]) -> int:
    """How many leading drafts equal the tokens produced at their positions."""
    n = 0
    for d, t in zip(drafts, actual, strict=False):
        if d != t:
            break
        n += 1
    return n


class ShadowDrafts:
    """The pending shadow proposals of one engine, by request id."""

    def __init__(self, stats: AcceptanceStats) -> None:
        self._stats = stats
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def wants(self, req: Request) -> bool:
        """Whether `req` (held at no drafts this round) should be asked for a shadow proposal."""
        return req.spec_method in SHADOW_METHODS and req.request_id not in self._pending

    def add(self, req: Request, drafts: Sequence[int]) -> None:
        """`drafts` were proposed for `req` as it is now; no drafts is a step with none."""
        if not drafts:
            self._stats.record(req.spec_method, req.spec_class, 0, 0, verified=False)
            return
        self._pending[req.request_id] = _Pending(req.spec_method, req.spec_class,
                                                 req.num_tokens, tuple(drafts))

    def score(self, req: Request) -> None:
        """Score `req`'s pending proposal once the tokens at all its positions are known."""
        p = self._pending.get(req.request_id)
        if p is None or req.num_tokens < p.position + len(p.drafts):
            return
        del self._pending[req.request_id]
        actual = req.all_token_ids[p.position:p.position + len(p.drafts)]
        self._stats.record(p.method, p.request_class, len(p.drafts),
                           matched_prefix(p.drafts, actual), verified=False)

    def release(self, request_id: str) -> None:
        """The request ended: a proposal not yet scored is dropped (its tail was never
        produced, and counting it short would bias the numbers)."""
        self._pending.pop(request_id, None)


def propose_shadows(held: Sequence[Request], proposer: Proposer, shadow: ShadowDrafts) -> None:
    """Ask `proposer` for drafts at each held request's own cap (`draft_cap` reads the
    budget's 0 in `spec_step_k`, lifted for this call only) and keep them pending in
    `shadow`. The requests' own drafts for the next step stay empty."""
    held = [r for r in held if shadow.wants(r)]
    if not held:
        return
    for r in held:
        r.spec_step_k = -1
    try:
        drafts = proposer.propose_batch(held)
    finally:
        for r in held:
            r.spec_step_k = 0
    for r, d in zip(held, drafts, strict=True):
        shadow.add(r, d)
