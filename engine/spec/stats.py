"""Speculative decoding's measured acceptance on a worker, per proposer and request class
(the class the gateway sent: e.g. "repetitive" or "text"), smoothed, for the policy here
(budget.py) and at the gateway (LoadReport.spec_acceptance); and vLLM's cumulative counters
(drafts, accepted tokens per position).

A step of a request that speculates counts whether or not its proposer found drafts (a method
that rarely finds any gains little), but not a step the worker's own budget kept at no drafts
(that says nothing of the method); likewise a draft position counts only in the steps that
allowed it (a step the budget held at 2 drafts says nothing of the 3rd and 4th). Per position,
drafted and accepted are reported as shares of the steps that allowed it, scaled to all steps:
counted as not drafted, the positions above a lowered cap looked like a method that finds no
drafts there, so the budget (and the gateway) judged k = 4 no better than the cap it had set,
and the cap never rose again. Each step's weight decays by ACCEPTANCE_DECAY per later step
of the same (method, class): the numbers follow a workload that changes within a few hundred
steps.

`DraftRounds` counts what the worker itself decided in each drafting round (cumulative, for
/metrics): the drafts its step budget allowed a request, and the pauses it began, per proposer
and class. The gateway's cap is only where a request starts; these say where the worker went
below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_api.spec_gain import Acceptance

ACCEPTANCE_DECAY = 0.995


@dataclass(slots=True)
class _Decayed:
    steps: float = 0.0
    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    allowed: list[float] = field(default_factory=list)  # per position: steps that allowed it

    def add(self, num_drafts: int, num_accepted: int, positions: int, allowed: int) -> None:
        d = ACCEPTANCE_DECAY
        if len(self.drafted) < positions:
            grow = [0.0] * (positions - len(self.drafted))
            self.drafted.extend(grow)
            self.accepted.extend(grow)
            self.allowed.extend(grow)
        self.steps = self.steps * d + 1.0
        for i in range(positions):
            here = i < allowed
            self.allowed[i] = self.allowed[i] * d + here
            self.drafted[i] = self.drafted[i] * d + (here and i < num_drafts)
            self.accepted[i] = self.accepted[i] * d + (here and i < num_accepted)

    def snapshot(self) -> Acceptance:
        """Per position the shares of the steps that allowed it, over all `steps` (a position
        no step allowed: none drafted)."""
        scale = [self.steps / a if a > 0 else 0.0 for a in self.allowed]
        return Acceptance(self.steps, tuple(x * f for x, f in zip(self.drafted, scale, strict=True)),
                          tuple(x * f for x, f in zip(self.accepted, scale, strict=True)))


@dataclass(slots=True)
class DraftRounds:
    """Cumulative per-round drafting decisions of the worker (engine/spec/__init__.py's
    `propose_all`): request-rounds by (method, class, drafts allowed), 0 where the step budget
    held the request at none; pauses begun by (method, class)."""

    allowed: dict[tuple[str, str, int], int] = field(default_factory=dict)
    pauses: dict[tuple[str, str], int] = field(default_factory=dict)

    def count_round(self, method: str, request_class: str, allowed: int) -> None:
        key = (method, request_class, allowed)
        self.allowed[key] = self.allowed.get(key, 0) + 1

    def count_pause(self, method: str, request_class: str) -> None:
        key = (method, request_class)
        self.pauses[key] = self.pauses.get(key, 0) + 1


class AcceptanceStats:
    def __init__(self, max_positions: int) -> None:
        self.max_positions = max_positions
        self._by_key: dict[tuple[str, str], _Decayed] = {}
        # vLLM's counters: verify steps with drafts, and per position the drafts accepted.
        self.num_drafts = 0
        self.accepted_per_pos = [0] * max_positions

    def record(self, method: str, request_class: str, num_drafts: int, num_accepted: int,
               verified: bool = True, allowed: int | None = None) -> None:
        """One step of a speculating request: `num_drafts` verified, `num_accepted` accepted,
        of at most `allowed` (the step's cap; None: every position). `verified` False: a
        shadow proposal's score (shadow.py), which counts in the smoothed acceptance but not
        in vLLM's counters of verified drafts."""
        entry = self._by_key.get((method, request_class))
        if entry is None:
            entry = self._by_key[(method, request_class)] = _Decayed()
        cap = self.max_positions if allowed is None else max(allowed, num_drafts)
        entry.add(num_drafts, num_accepted, self.max_positions, cap)
        if num_drafts and verified:
            self.num_drafts += 1
            for i in range(min(num_accepted, self.max_positions)):
                self.accepted_per_pos[i] += 1

    def acceptance(self, method: str, request_class: str) -> Acceptance | None:
        entry = self._by_key.get((method, request_class))
        return None if entry is None else entry.snapshot()

    def items(self) -> list[tuple[str, str, Acceptance]]:
        """Every (method, class) measured, with its acceptance (a copy)."""
        return [(m, c, e.snapshot()) for (m, c), e in sorted(self._by_key.items())]

    def forget(self, request_class: str) -> None:
        """Drop a class's numbers (the start-up calibration's synthetic requests)."""
        for key in [k for k in self._by_key if k[1] == request_class]:
            del self._by_key[key]
