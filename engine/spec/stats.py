"""Speculative decoding's measured acceptance on a worker, per proposer and request class
(the class the gateway sent: e.g. "repetitive" or "text"), smoothed, for the policy here
(budget.py) and at the gateway (LoadReport.spec_acceptance); and vLLM's cumulative counters
(drafts, accepted tokens per position).

A step of a request that speculates counts whether or not its proposer found drafts (a method
that rarely finds any gains little), but not a step the worker's own budget kept at no drafts
(that says nothing of the method). Each step's weight decays by ACCEPTANCE_DECAY per later step
of the same (method, class): the numbers follow a workload that changes within a few hundred
steps.
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

    def add(self, num_drafts: int, num_accepted: int, positions: int) -> None:
        d = ACCEPTANCE_DECAY
        if len(self.drafted) < positions:
            self.drafted.extend([0.0] * (positions - len(self.drafted)))
            self.accepted.extend([0.0] * (positions - len(self.accepted)))
        self.steps = self.steps * d + 1.0
        for i in range(positions):
            self.drafted[i] = self.drafted[i] * d + (1.0 if i < num_drafts else 0.0)
            self.accepted[i] = self.accepted[i] * d + (1.0 if i < num_accepted else 0.0)

    def snapshot(self) -> Acceptance:
        return Acceptance(self.steps, tuple(self.drafted), tuple(self.accepted))


class AcceptanceStats:
    def __init__(self, max_positions: int) -> None:
        self.max_positions = max_positions
        self._by_key: dict[tuple[str, str], _Decayed] = {}
        # vLLM's counters: verify steps with drafts, and per position the drafts accepted.
        self.num_drafts = 0
        self.accepted_per_pos = [0] * max_positions

    def record(self, method: str, request_class: str, num_drafts: int, num_accepted: int,
               verified: bool = True) -> None:
        """One step of a speculating request: `num_drafts` verified, `num_accepted` accepted.
        `verified` False: a shadow proposal's score (shadow.py), which counts in the smoothed
        acceptance but not in vLLM's counters of verified drafts."""
        entry = self._by_key.get((method, request_class))
        if entry is None:
            entry = self._by_key[(method, request_class)] = _Decayed()
        entry.add(num_drafts, num_accepted, self.max_positions)
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
