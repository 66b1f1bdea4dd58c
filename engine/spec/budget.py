"""The worker's per-step cap on drafts: within each request's cap (the gateway's choice), as
many as pay for the batch as it is now (engine_api/spec_gain.py's `best_k` with this worker's
measured step cost and acceptance, for the running batch's size).

The gateway decided at admission for the load it saw; the batch changes every step. Where the
numbers are missing (no steps measured yet for the method and class) the request's cap stands;
a method kept at no drafts stays measured: n-gram and suffix decoding by shadow drafts
(shadow.py), a draft model (too dear to run for nothing) by letting its cap stand for one of its
requests every EXPLORE_EVERY-th round, at the cost of one sequence's rows, not the whole
batch's. A method kept at some drafts but fewer than the engine's cap is measured above that cap
the same way, every POSITION_EXPLORE_EVERY-th round, shadowed or not: shadow drafts skip the
method a request verifies, so without this the positions above a cap lowered once (by a first
step's poor numbers) were never measured again and the cap never rose (suffix decoding on
free text stayed at 1 draft for good on the CPU: bench/results/cpu_spec_budget_trace/).
"""

from __future__ import annotations

from engine.spec.cost import StepCostModel
from engine.spec.stats import AcceptanceStats
from engine_api.spec_gain import SHADOWED_METHODS, best_k

# Measured steps a (method, class) needs before its numbers cap anything.
MIN_MEASURED_STEPS = 16.0
EXPLORE_EVERY = 16
POSITION_EXPLORE_EVERY = 4


class StepBudget:
    def __init__(self, cost: StepCostModel, stats: AcceptanceStats, max_k: int) -> None:
        self.cost = cost
        self.stats = stats
        self.max_k = max_k  # the engine's own cap
        self._rounds: dict[tuple[str, str], int] = {}

    def cap_for(self, memo: dict[tuple[str, str], int], method: str, request_class: str,
                batch: int, request_k: int, kv_tokens: float = 0.0) -> int:
        """Drafts this round for a request of (method, class) allowed `request_k`, in a batch of
        `batch` sequences whose contexts sum to `kv_tokens`; `memo` holds the round's caps by
        key (one computation per key and round)."""
        key = (method, request_class)
        cap = memo.get(key)
        if cap is None:
            cap, explore = self._cap(key, batch, kv_tokens)
            memo[key] = cap
            if explore:  # this request, the round's first of the key, drafts its cap
                return request_k
        return min(cap, request_k)

    def _cap(self, key: tuple[str, str], batch: int, kv_tokens: float) -> tuple[int, bool]:
        """The key's cap this round, and whether one request of it explores."""
        rounds = self._rounds[key] = self._rounds.get(key, 0) + 1
        acceptance = self.stats.acceptance(*key)
        cost = self.cost.cost(kv_tokens)
        if acceptance is None or acceptance.steps < MIN_MEASURED_STEPS or not cost:
            return self.max_k, False
        k = best_k(cost, acceptance, batch, self.max_k).k
        # A cheap proposer's held requests are measured by shadow drafts (shadow.py): no
        # request needs to draft for its numbers at a cap of 0; above a lowered cap, one does.
        if 0 < k < self.max_k:
            return k, rounds % POSITION_EXPLORE_EVERY == 0
        return k, rounds % EXPLORE_EVERY == 0 and key[0] not in SHADOWED_METHODS
