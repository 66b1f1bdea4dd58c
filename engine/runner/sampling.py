"""Sampling a step's logits: the sampler's rows and the rejection sampler's (requests verifying
drafts), and `PendingStep`, the handle on tokens still on their way to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.pooling import PendingPooling
from engine.prompt_logprobs import PendingPromptLogprobs
from engine.request import Request
from engine.sampler import PendingTokens, Sampler, to_device
from engine.scheduler import SampledToken, SchedulerOutput
from engine.spec import needs_sync
from engine.spec.rejection import PendingVerify, verify


class PendingStep:
    """A launched step whose sampled tokens (and verified drafts) have not reached the host."""

    def __init__(self, tokens: PendingTokens | None, verify: PendingVerify | None = None,
                 speculative: bool = False, prompt: PendingPromptLogprobs | None = None,
                 pooled: PendingPooling | None = None) -> None:
        """speculative: the engine speculates, so requests may need their tokens on the host
        before the next step is scheduled (`needs_sync`); without it that check is skipped.
        prompt: the step's prompt logprobs, when it scored prompt tokens. pooled: its
        embedding requests' pooled rows, when it ran any (engine/pooling.py)."""
        self.tokens = tokens
        self.verify = verify
        self.prompt = prompt
        self.pooled = pooled
        reqs = (tokens.reqs if tokens is not None else []) + (verify.reqs if verify else [])
        # Drafting the next tokens (speculative decoding) needs every earlier token on the host
        # first: such a step is finished before the next one is scheduled. (Sampling that reads
        # the output history — penalties, min_tokens, a grammar — gets it from `launch`'s
        # `settle` instead, between the next step's forward pass and its sampling.)
        if speculative:
            sync = [needs_sync(r) for r in reqs]  # every counter ticks
            self.overlappable = not any(sync)
        else:
            self.overlappable = True

    def result(self) -> dict[str, SampledToken]:
        out: dict[str, SampledToken] = {}
        if self.tokens is not None:
            ids, logprobs = self.tokens.result()
            out = {r.request_id: SampledToken(tok, lp)
                   for r, tok, lp in zip(self.tokens.reqs, ids, logprobs, strict=True)}
        if self.verify is not None:
            for r, emitted in zip(self.verify.reqs, self.verify.result(), strict=True):
                out[r.request_id] = SampledToken(emitted[0], None, emitted[1:])
        return out


def _draft_probs(logits: torch.Tensor, reqs: Sequence[Request],
                 drafts: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """The rejection sampler's q rows ([rows, V], zero on bonus rows) when a randomly
    sampling request's drafts were sampled from a distribution (a draft model's,
    `Request.spec_draft_probs`); other requests' drafts are one-hot. None: every draft is
    deterministic (greedy requests ignore q)."""
    if not any(r.spec_draft_probs is not None and not r.sampling_params.greedy for r in reqs):
        return None
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    one_hot_rows: list[int] = []
    one_hot_tokens: list[int] = []
    row = 0
    for req, d in zip(reqs, drafts, strict=True):
        probs = req.spec_draft_probs
        if isinstance(probs, torch.Tensor) and not req.sampling_params.greedy:
            q[row:row + len(d)] = probs[:len(d)]
        else:
            one_hot_rows.extend(range(row, row + len(d)))
            one_hot_tokens.extend(d)
        row += len(d) + 1
    if one_hot_rows:
        q[to_device(one_hot_rows, torch.long, q.device),
          to_device(one_hot_tokens, torch.long, q.device)] = 1.0
    return q


def sample_and_verify(sampler: Sampler, logits: torch.Tensor, out: SchedulerOutput,
                      prompt: PendingPromptLogprobs | None = None) -> PendingStep:
    """Split the logits rows: requests with drafts go to the rejection sampler (all their
    rows), the others to `sampler` (their one row).

    The step finishes before the next is scheduled (`PendingStep.overlappable`), so no later
    step gathers its tokens on the device."""
    plain_rows: list[int] = []
    plain_reqs: list[Request] = []
    spec_rows: list[int] = []
    spec_reqs: list[Request] = []
    drafts: list[Sequence[int]] = []
    row = 0
    for s in out.scheduled:
        if not s.sample:
            continue
        if s.draft_token_ids:
            n = 1 + len(s.draft_token_ids)
            spec_rows.extend(range(row, row + n))
            spec_reqs.append(s.request)
            drafts.append(s.draft_token_ids)
            row += n
        else:
            plain_rows.append(row)
            plain_reqs.append(s.request)
            row += 1
    dev = logits.device
    tokens = None
    if plain_reqs:
        idx = to_device(plain_rows, torch.long, dev)
        tokens = sampler.sample(logits.index_select(0, idx), plain_reqs)
    spec_idx = to_device(spec_rows, torch.long, dev)
    spec_logits = logits.index_select(0, spec_idx)
    return PendingStep(tokens, verify(spec_logits, spec_reqs, drafts,
                                      _draft_probs(spec_logits, spec_reqs, drafts)),
                       speculative=True, prompt=prompt)
