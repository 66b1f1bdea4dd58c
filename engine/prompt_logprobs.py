"""Prompt logprobs: the log-probability the model gives each prompt token after the tokens
before it (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`, which lm-eval's
log-likelihood tasks read).

The hidden state at prompt position p scores token p + 1, so a prefill chunk over positions
[start, end) scores tokens start + 1 .. min(end, P - 1) of a P-token prompt (position P - 1 is
the sampling row: it scores the first output token). The engine computes every position of
such a request itself: the scheduler gives it no prefix-cache hits and the services no remote
KV until its prompt is scored (`Request.scores_prompt`). Each chunk's rows are planned once at
launch (`Request.num_prompt_logprobs_planned`), so a prompt recomputed after a preemption is
not scored twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kernels.reference import score_rows_ref
from engine.logprobs import PromptLogprobs
from engine.request import Request
from engine.sampler import copies_queued, to_device, to_host
from engine.scheduler import ScheduledRequest, first_rows

# Rows turned into logits at a time: 512 rows of a 128k vocabulary are 128 MB of bf16 logits
# (256 MB of float32 on a CPU engine).
_ROWS_PER_SLICE = 512


@dataclass(frozen=True, slots=True)
class PromptRows:
    """`count` rows of a step's hidden states, from `row` on, that score a request's prompt
    tokens `first_target`, `first_target + 1`, ..."""

    request: Request
    first_target: int
    row: int
    count: int


def plan_prompt_rows(scheduled: Sequence[ScheduledRequest]) -> list[PromptRows]:
    """The rows of this step (laid out as `ModelRunner.prepare` lays them: each request's new
    tokens in order) that score prompt tokens, marked planned on their requests."""
    plans: list[PromptRows] = []
    for s, row in first_rows(scheduled):
        req = s.request
        if req.scores_prompt:
            first = max(s.num_computed_tokens, req.num_prompt_logprobs_planned)
            end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
            if first < end:
                plans.append(PromptRows(req, first + 1, row + first - s.num_computed_tokens,
                                        end - first))
                req.num_prompt_logprobs_planned = end
                req.scores_prompt = end < req.num_prompt_tokens - 1
    return plans


class PendingPromptLogprobs:
    """One step's prompt logprobs, still on the device until `result()`."""

    def __init__(self, plans: list[PromptRows], chosen: torch.Tensor, ranks: torch.Tensor,
                 top_vals: torch.Tensor | None, top_ids: torch.Tensor | None) -> None:
        """Starts the copies to the host; `result()` waits for them only (under async
        scheduling a later step is already queued behind them)."""
        self.plans = plans
        self._chosen = to_host(chosen)
        self._ranks = to_host(ranks)
        self._top_vals = None if top_vals is None else to_host(top_vals)
        self._top_ids = None if top_ids is None else to_host(top_ids)
        self._event = copies_queued(chosen)

    def result(self) -> list[tuple[Request, PromptLogprobs]]:
        """Per planned request, its scored tokens in prompt order (column slices: no object
        per token)."""
        if self._event is not None:
            self._event.synchronize()
        out: list[tuple[Request, PromptLogprobs]] = []
        i = 0
        for p in self.plans:
            k = p.request.sampling_params.prompt_logprobs or 0
            rows = slice(i, i + p.count)
            scored = PromptLogprobs(
                k, p.request.prompt_token_ids[p.first_target:p.first_target + p.count],
                self._chosen[rows].tolist(), self._ranks[rows].tolist())
            if k and self._top_ids is not None and self._top_vals is not None:
                scored.top_ids = self._top_ids[rows, :k].reshape(-1).tolist()
                scored.top_logprobs = self._top_vals[rows, :k].reshape(-1).tolist()
            out.append((p.request, scored))
            i += p.count
        return out


def score_prompt_rows(hidden: torch.Tensor, plans: list[PromptRows],
                      compute_logits: Callable[[torch.Tensor, bool], torch.Tensor]
                      ) -> PendingPromptLogprobs:
    """The scored tokens' logprobs and ranks and each row's top-k (k: the largest any planned
    request asked for) from the model's raw logits at the planned rows (no temperature,
    penalty or bias: the model's own distribution, as sampled tokens' logprobs are).

    Logits are made `_ROWS_PER_SLICE` rows at a time, in the model's dtype, so a long chunk
    never holds them all; on a GPU one Triton pass per row (engine/kernels/score.py) finds the
    log-sum-exp, the target's logprob and rank and the argmax, instead of a float32 copy, a
    log-softmax and a comparison over the whole slice. The top-1 (lm-eval's `logprobs=1`) is
    that argmax; a top-k beyond it is `topk` on the slice's logits less the log-sum-exp."""
    dev = hidden.device
    rows = to_device([p.row + j for p in plans for j in range(p.count)], torch.long, dev)
    targets = to_device([t for p in plans for t in
                         p.request.prompt_token_ids[p.first_target:p.first_target + p.count]],
                        torch.long, dev)
    k = max(p.request.sampling_params.prompt_logprobs or 0 for p in plans)
    n = rows.shape[0]
    chosen = torch.empty(n, dtype=torch.float32, device=dev)
    ranks = torch.empty(n, dtype=torch.long, device=dev)
    top_vals = torch.empty((n, k), dtype=torch.float32, device=dev) if k else None
    top_ids = torch.empty((n, k), dtype=torch.long, device=dev) if k else None
    score = _fused_scores if dev.type == "cuda" else score_rows_ref
    for start in range(0, n, _ROWS_PER_SLICE):
        end = min(start + _ROWS_PER_SLICE, n)
        logits = compute_logits(hidden.index_select(0, rows[start:end]), False)
        chosen[start:end], ranks[start:end], lse, best = score(logits, targets[start:end])
        if top_vals is not None and top_ids is not None:
            if k == 1:
                top_ids[start:end, 0] = best
                top_vals[start:end, 0] = logits.gather(1, best[:, None]).squeeze(1).float() - lse
            else:
                vals, ids = logits.topk(k, dim=-1)
                top_vals[start:end], top_ids[start:end] = vals.float() - lse[:, None], ids
    return PendingPromptLogprobs(plans, chosen, ranks, top_vals, top_ids)


def _fused_scores(logits: torch.Tensor, targets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from engine.kernels import score_rows  # Triton: GPU engines only

    return score_rows(logits, targets)
