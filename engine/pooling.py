"""Embeddings: an embedding request's prompt is computed like any other (chunked prefill,
batched beside other requests), samples no token, and finishes when its prompt does, with its
pooled hidden state (the final norm's output, before the LM head) in float32 — vLLM's pooling
runner for decoder models (Qwen3-Embedding: LAST, normalized).

The same seam as prompt logprobs (engine/prompt_logprobs.py): the rows of each step that hold a
request's pooled prompt positions are planned at launch, once each (`PoolingState.num_planned`,
so a prompt recomputed after a preemption is not pooled twice), reduced on the device, copied to
the host without waiting, and added up on the host across chunks (`accumulate`). Every pooling
type is a sum over a span of positions (`PoolingState.positions`): MEAN sums them all, LAST and
CLS take one.

Prefix caching: positions a prefix-cache hit serves are not recomputed, so their hidden states
never exist. LAST needs only the last position, which is always computed (a hit leaves at least
one token): it takes hits as any prompt does. MEAN and CLS take none until their positions are
planned (`Request.computes_whole_prompt`, as prompt logprobs do); their prompts' blocks still
fill the cache for later requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import PoolingState, Request
from engine.sampler import copies_queued, to_host
from engine.scheduler import ScheduledRequest, first_rows


@dataclass(frozen=True, slots=True)
class PoolRows:
    """`count` rows of a step's hidden states, from `row` on, that `request` pools (0: none,
    but the step completes its prompt: it finishes with the step)."""

    request: Request
    row: int
    count: int


def plan_pool_rows(scheduled: Sequence[ScheduledRequest]) -> list[PoolRows]:
    """Per embedding request of the step, its rows (`first_rows`' layout) holding positions it
    pools and not pooled yet, now marked planned; an empty plan for one whose prompt the step
    completes without such rows (CLS, a preempted LAST), so that it finishes with the step."""
    plans: list[PoolRows] = []
    for s, row in first_rows(scheduled):
        state = s.request.pooling
        if state is None:
            continue
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        lo, hi = state.positions
        first, last = max(start, lo, state.num_planned), min(end, hi)
        count = max(0, last - first)
        if count:
            state.num_planned = last
        if count or end == state.num_prompt_tokens:
            plans.append(PoolRows(s.request, row + first - start if count else row, count))
    return plans


class PendingPooling:
    """One step's pooled sums, still on the device until `result()`."""

    def __init__(self, plans: list[PoolRows], sums: torch.Tensor) -> None:
        """Starts the copy to the host (`sums`: [len(plans), hidden] float32)."""
        self.plans = plans
        self._sums = to_host(sums)
        self._event = copies_queued(sums)

    def result(self) -> list[tuple[Request, torch.Tensor]]:
        """Per planned request, the float32 sum of its rows in this step ([hidden])."""
        if self._event is not None:
            self._event.synchronize()
        return [(p.request, self._sums[i]) for i, p in enumerate(self.plans)]


def pool_rows(hidden: torch.Tensor, plans: list[PoolRows]) -> PendingPooling:
    """Each plan's rows of `hidden` ([T, hidden], the final norm's output) summed in float32.
    A contiguous slice per request (not an index_add, whose atomics would make the sum's order,
    and so its last bits, vary from run to run on a GPU)."""
    sums = torch.zeros(len(plans), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for i, p in enumerate(plans):
        if p.count:
            sums[i] = hidden[p.row:p.row + p.count].float().sum(0)
    return PendingPooling(plans, sums)


def accumulate(state: PoolingState, part: torch.Tensor) -> None:
    """Add a step's sum to the request's (the host side of a chunked prompt)."""
    total = state.total
    state.total = part.clone() if not isinstance(total, torch.Tensor) else total + part


def embedding(state: PoolingState) -> list[float]:
    """The request's embedding: the mean (MEAN) or the position's hidden state (LAST, CLS),
    its first `dimensions` features, L2-normalized when `normalize` (after the truncation:
    Matryoshka embeddings are renormalized)."""
    total = state.total
    if not isinstance(total, torch.Tensor):
        raise RuntimeError("an embedding request finished before its rows were pooled")
    lo, hi = state.positions
    vec = total / (hi - lo)
    params = state.params
    vec = vec[:params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.tolist()
