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

    def pause_floor(self, batch: int, k: int, kv_tokens: float = 0.0) -> float | None:
        """Accepted drafts per verify step below which one request's `k` drafts cost its batch
        of `batch` sequences (their contexts summing to `kv_tokens`) more time than they give
        tokens; None until verify steps were measured. Its drafts add dt to the step of t
        seconds; the batch, alike, emits batch * (1 + a) tokens a step; they pay while
        a >= dt * batch * (1 + a) / t, that is a >= x / (1 - x) with x = dt * batch / t.
        Where the step is weights-bound (a GPU's small batches) dt is small: on the H100 a
        request in a batch of 16 pays from about 0.2 accepted drafts a step, and at 30%
        acceptance (0.43 a step) no longer pauses, which the constant floor of 0.4 often did
        (the policy at 0.80-0.89 of always drafting there). Where it is compute-bound (the CPU)
        one draft row costs about what a sequence's row does, and it reads about one draft a
        step; `propose_all` only lets it lower the configured floor."""
        cost = self.cost.cost(kv_tokens)
        if k <= 0 or not cost.verify_rows:
            return None
        rows = batch * (1 + k)
        t = cost.seconds_at(rows, True, batch)
        if t <= 0:
            return None
        # Alone, a plain step; else the same verify step, which a verify graph pads to the same
        # rows (its drafts are free: no floor).
        without = cost.seconds_at(rows - k, batch > 1, batch)
        x = max(0.0, t - without) * batch / t
        return x / (1.0 - x) if x < 1.0 else float(k)

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
