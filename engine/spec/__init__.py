"""Speculative decoding: proposers draft tokens, the target model scores them all in one step,
and the rejection sampler keeps the target's distribution exactly (docs/architecture.md, "Engine internals").

    proposer (after a step, per request)  →  request.spec_token_ids
    scheduler (next step)                 →  1 + len(drafts) query rows for that request
    runner                                →  logits at every row  →  rejection sampler
    scheduler                             →  accepted drafts + one target token appended,
                                             computed tokens rolled back past the rejected ones

The rejected drafts' KV was written into slots past the sequence's end; the next step
overwrites them, and they are never hashed into the prefix cache (only known tokens are).

The draft-model proposer runs a model runner of its own, so it lives above the runner and the
scheduler (engine/draft_model.py), both of which import this package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.request import Request
    from engine.spec.stats import DraftRounds


def draft_cap(req: Request) -> int:
    """Drafts a proposer may give `req` this round: its cap (`num_speculative_tokens`, the
    gateway's choice within the engine's), lowered by the worker's step budget when that has
    set one (`spec_step_k` >= 0: budget.py)."""
    cap = req.num_speculative_tokens
    return cap if req.spec_step_k < 0 else min(cap, req.spec_step_k)


class Proposer(Protocol):
    """Drafts tokens for a batch of requests (called between steps, for the requests that
    speculate). N-gram lookup (ngram.py), suffix decoding (suffix.py) and a draft model
    (engine/draft_model.py) are built. Suffix decoding keeps a tree per request (and one over
    finished requests' outputs); the draft model runs all of a step's requests as one batch and
    keeps each one's draft KV between calls; both are told when a request is gone
    (`release`)."""

    def propose_batch(self, reqs: Sequence[Request]) -> list[list[int]]:
        """Up to `draft_cap(req)` drafts to follow `req.all_token_ids` (maybe
        none), for each request. A proposer that samples its drafts sets
        `req.spec_draft_probs` to their distributions (the rejection sampler's q)."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop what the proposer keeps for it."""
        ...

    def shutdown(self) -> None:
        """Give back what the proposer holds (a draft model's device memory)."""
        ...


class SequenceProposer:
    """A stateless proposer that looks at one sequence at a time (no batching to gain)."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, reqs: Sequence[Request]) -> list[list[int]]:
        return [self.propose(r.all_token_ids, draft_cap(r)) for r in reqs]

    def release(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


# After a proposal finds no drafts, a request's steps overlap with the host again (async
# scheduling) for this many steps; then one step finishes before the next is scheduled, so the
# proposer sees the latest token and can catch a loop that began. Drafting needs the last token
# on the host, which async scheduling delays by a step: without this, speculation cost every
# step its overlap, 10% of a batch-1 step on the H200 (4.55 vs 4.13 ms per token with no
# drafts found, bench/results/h200/probe_spec_90c7665.json).
SPEC_PROBE_INTERVAL = 8
# A request's pause from drafting (its recent verify steps accepted fewer drafts than the floor):
# the average of accepted drafts per verify step remembers about four steps (weight of the past
# 0.75) and restarts at RESUME_AVG_FACTOR x the floor after a pause, so a request whose drafts
# keep failing pauses again within two verify steps; each pause that follows another without the
# average recovering to that level is twice as long (up to MAX_PAUSE_TOKENS). With a weight of
# 0.5 and a restart at the floor, two verify steps that accepted nothing paused a request whose
# drafts were right 60% of the time (1.5 accepted per step: 16% of step pairs), and after a pause
# one such step did: on the H200 that request ran at 0.72x always-on (issue 37's table); in a
# simulation of 2,000 tokens at k = 4 it took 1,211 steps against 866 always drafting (now 938),
# while a request whose drafts always fail verifies 65 times (was 223).
SPEC_AVG_KEEP = 0.75
RESUME_AVG_FACTOR = 1.5
MAX_PAUSE_TOKENS = 64
# A pause also needs the average over about twenty verify steps (weight of the past 0.95) below
# the floor. The four-step average alone is noisy where the floor is near the request's mean: at
# 30% acceptance (0.43 drafts a step) and the H100's measured floor for one sequence (0.24) it
# dipped below a quarter of the time, and once it did, two steps that accepted nothing (half
# of all pairs) paused the request again, for longer each time: it drafted 92 tokens where
# always-on drafted 349, and ran at 0.88 of it (bench/results/h100/spec_policy_1205/
# bf7b07a_repeats3.json, batch 1). The long average restarts at RESUME_LONG_AVG_FACTOR x the
# floor after a pause: left where it was, a run of bad luck held it below the floor through the
# pauses (no verify steps to raise it), and the request still drafted in only half its steps;
# restarted at 1.5 x, a request whose drafts are never right verified in 12% of its steps (8
# verify steps to fall below the floor again after each pause). At 1.2 x (4 steps): that
# request 6.5%, the one at 30% drafts in 72-90% of its steps (tests/unit/engine/
# test_spec_budget.py).
SPEC_LONG_AVG_KEEP = 0.95
RESUME_LONG_AVG_FACTOR = 1.2


def propose_all(reqs: Sequence[Request], proposer: Proposer,
                min_accepted_per_step: float,
                step_k: Callable[[Request], int] | None = None,
                pause_floor: Callable[[Request], float | None] | None = None,
                rounds: DraftRounds | None = None) -> None:
    """Set each request's `spec_token_ids`, the drafts it verifies next step (maybe none), and
    when the proposer looks again (`spec_sync_in`, for async scheduling).

    A request whose recent verify steps accepted fewer than `min_accepted_per_step` drafts per
    step is not asked: it pauses drafting for the next SPEC_PROBE_INTERVAL tokens (counted in
    tokens, so a synchronous engine pauses as long as an overlapping one; twice as long for each
    pause that follows another before its average recovered, see RESUME_AVG_FACTOR), and its
    average then restarts above the floor, so the next verify steps decide whether drafting goes
    on. The rest are asked in one batch; no drafts found: the next SPEC_PROBE_INTERVAL steps may
    overlap before the next look. `step_k(req)`: the worker's cap for this round (budget.py),
    kept in `spec_step_k`; a request it gives no drafts is not asked either. `pause_floor(req)`:
    the floor measured for the request's batch (budget.py's `pause_floor`), which lowers
    `min_accepted_per_step` where it is lower (a floor of 0: pauses off). It never raises it: a
    pause is coarse (8-64 tokens, decided on a four-step average), and a measured floor above
    0.4 (about one draft a step on the 2-core CPU) paused stories whose acceptance merely
    varied, 0.90 of always drafting at 32 against 1.02 (bench/results/cpu_spec_policy_floor_7641f29/);
    the step budget lowers a class's drafts where they do not pay on average. `rounds`: where
    the decisions are counted (the drafts each asked or held request was allowed, the pauses
    begun)."""
    asked: list[Request] = []
    for req in reqs:
        if step_k is not None:
            req.spec_step_k = step_k(req)
            if req.spec_step_k == 0:  # its steps may overlap until the next look
                req.spec_token_ids = []
                req.spec_sync_in = SPEC_PROBE_INTERVAL
                if rounds is not None:
                    rounds.count_round(req.spec_method, req.spec_class, 0)
                continue
        floor = min_accepted_per_step
        if pause_floor is not None and floor > 0 and not req.spec_fixed:
            measured = pause_floor(req)
            floor = floor if measured is None else min(floor, measured)
        paused_for = req.spec_resume_at - req.num_tokens
        resume_avg = RESUME_AVG_FACTOR * floor
        if paused_for <= 0 and req.spec_accepted_avg > resume_avg:
            req.spec_pause_tokens = 0  # recovered since its restart: the next pause is short
        if paused_for <= 0 and req.spec_accepted_avg < floor \
                and req.spec_accepted_long_avg < floor:
            paused_for = (SPEC_PROBE_INTERVAL if not req.spec_pause_tokens
                          else min(2 * req.spec_pause_tokens, MAX_PAUSE_TOKENS))
            req.spec_pause_tokens = paused_for
            req.spec_accepted_avg = resume_avg
            req.spec_accepted_long_avg = RESUME_LONG_AVG_FACTOR * floor
            req.spec_resume_at = req.num_tokens + paused_for
            if rounds is not None:
                rounds.count_pause(req.spec_method, req.spec_class)
        if paused_for > 0:
            req.spec_token_ids = []
            req.spec_sync_in = paused_for
        else:
            asked.append(req)
            if rounds is not None:
                rounds.count_round(req.spec_method, req.spec_class, draft_cap(req))
    if not asked:
        return
    for req in asked:
        req.spec_draft_probs = None
    drafts = proposer.propose_batch(asked)
    for req, d in zip(asked, drafts, strict=True):
        req.spec_token_ids = d
        req.spec_sync_in = 0 if d else SPEC_PROBE_INTERVAL


def record_verify(req: Request, num_drafts: int, num_accepted: int) -> None:
    """Count a verify step's outcome for `req` and fold it into its moving average of
    accepted drafts per step (the first step sets it)."""
    req.num_draft_tokens += num_drafts
    req.num_accepted_tokens += num_accepted
    req.spec_accepted_avg = _fold(req.spec_accepted_avg, num_accepted, SPEC_AVG_KEEP)
    req.spec_accepted_long_avg = _fold(req.spec_accepted_long_avg, num_accepted,
                                       SPEC_LONG_AVG_KEEP)


def _fold(avg: float, value: float, keep: float) -> float:
    return value if avg == float("inf") else keep * avg + (1 - keep) * value


def needs_sync(req: Request) -> bool:
    """Whether the step sampling `req`'s next token must finish before the next one is
    scheduled (the proposer drafts from it). Counts down the steps granted after a miss."""
    if not req.num_speculative_tokens:
        return False
    if req.spec_sync_in > 0:
        req.spec_sync_in -= 1
        return False
    return True
