"""Verify drafted tokens against the target model's logits, keeping its distribution exactly.

A request with d drafts owns d + 1 logits rows in the verify step: row j scores the token after
draft j - 1 (row 0: after the last known token). Walking the rows in order:

- greedy: draft j is accepted while it equals row j's argmax; the first mismatch emits the
  argmax instead. The output is the one plain greedy decoding gives, token for token.
- random, deterministic drafts (n-gram lookup, suffix decoding: q_j = one-hot(x_j)): row j
  draws its token from the filtered target distribution p_j (temperature, top-k/p, min-p)
  exactly as the plain sampler would, and draft x_j is accepted when it equals that draw. The
  draft is accepted with probability p_j(x_j), as rejection sampling would, and the emitted
  tokens are the plain sampler's own: a seeded request draws row by row from its generator,
  which is then set back to its state after the last emitted row, so its output equals plain
  decoding's token for token.
- random, a draft model's drafts (distribution q_j): draft x_j is accepted with probability
  min(1, p_j(x_j) / q_j(x_j)); the first rejection emits a sample of the residual
  max(0, p_j - q_j), normalised (Leviathan et al. 2023; Chen et al. 2023). The distribution is
  kept; a seeded request's tokens differ from plain decoding's (other draws).
- all d accepted: row d (the bonus row) emits a sample of p_d (its argmax when greedy).

Each row's verdict and its would-be token are computed on the device for all rows at once;
the host takes the first rejection per request from one copy of both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.sampler import (
    argmax_rows,
    copies_queued,
    draw_tokens,
    filter_probs,
    request_generator,
    to_device,
)


class PendingVerify:
    """Verdicts on their way to the host; `result()` waits and walks each request's rows."""

    def __init__(self, reqs: Sequence[Request], drafts: Sequence[Sequence[int]],
                 tokens: torch.Tensor, accepted: torch.Tensor,
                 rewind: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None) -> None:
        self.reqs = list(reqs)
        self.drafts = [list(d) for d in drafts]
        # Seeded rows: the request's generator and its state after that row's draw.
        self._rewind = rewind or {}
        self._tokens = tokens.to("cpu", non_blocking=True)
        self._accepted = accepted.to("cpu", non_blocking=True)
        self._event = copies_queued(tokens)

    def result(self) -> list[list[int]]:
        """The tokens each request emits: its accepted drafts, then one token of the target's."""
        if self._event is not None:
            self._event.synchronize()
        tokens: list[int] = self._tokens.tolist()
        accepted: list[bool] = self._accepted.tolist()
        out: list[list[int]] = []
        row = 0
        for drafts in self.drafts:
            n = 0
            while n < len(drafts) and accepted[row + n]:
                n += 1
            out.append([*drafts[:n], tokens[row + n]])
            last = self._rewind.get(row + n)
            if last is not None:  # the draws of rows past the emitted ones never happened
                last[0].set_state(last[1])
            row += len(drafts) + 1
        return out


def verify(logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[Sequence[int]],
           draft_probs: torch.Tensor | None = None) -> PendingVerify:
    """logits: [sum(len(d) + 1), V], each request's d + 1 rows in order.

    `draft_probs` ([rows, V], zero on bonus rows) is the proposer's distribution for a
    draft-model proposer; None means deterministic drafts (n-gram lookup)."""
    if len(reqs) != len(drafts):
        raise ValueError(f"{len(reqs)} requests but {len(drafts)} draft lists")
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.shape[0] != num_rows:
        raise ValueError(f"expected {num_rows} logits rows (drafts + 1 per request), got "
                         f"{logits.shape[0]}")
    dev = logits.device
    row_reqs: list[Request] = []
    draft_tokens: list[int] = []
    for req, d in zip(reqs, drafts, strict=True):
        row_reqs.extend([req] * (len(d) + 1))
        draft_tokens.extend(d)
        draft_tokens.append(0)  # bonus row: no draft; its verdict is never read
    draft = to_device(draft_tokens, torch.long, dev)
    has_draft = to_device([t for d in drafts for t in [True] * len(d) + [False]], torch.bool, dev)
    # Greedy rows (and the default for every row): the argmax is both verdict and token.
    tokens = argmax_rows(logits)
    accepted = (tokens == draft) & has_draft
    random_rows = [i for i, r in enumerate(row_reqs) if not r.sampling_params.greedy]
    rewind: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
    if random_rows:
        idx = to_device(random_rows, torch.long, dev)
        sub_reqs = [row_reqs[i] for i in random_rows]
        sub_logits = logits.index_select(0, idx).float()
        if draft_probs is None:
            sub_tokens, states = _draw_rows(filter_probs(
                sub_logits, [r.sampling_params for r in sub_reqs]), sub_reqs)
            sub_accepted = (sub_tokens == draft[idx]) & has_draft[idx]
            rewind = {random_rows[i]: state for i, state in states.items()}
        else:
            sub_tokens, sub_accepted = _verify_random(
                sub_logits, sub_reqs, draft[idx], has_draft[idx],
                draft_probs.index_select(0, idx).float())
        tokens.index_copy_(0, idx, sub_tokens)
        accepted.index_copy_(0, idx, sub_accepted)
    return PendingVerify(reqs, drafts, tokens, accepted, rewind)


def _draw_rows(probs: torch.Tensor, row_reqs: Sequence[Request]
               ) -> tuple[torch.Tensor, dict[int, tuple[torch.Generator, torch.Tensor]]]:
    """`draw_tokens`' exponential race, row by row in order, and each seeded row's generator
    with its state after the row's draw (for `PendingVerify` to set back)."""
    q = torch.empty_like(probs).exponential_()  # unseeded rows: one draw for all
    states: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
    for i, req in enumerate(row_reqs):
        gen = request_generator(req, probs.device)
        if gen is not None:
            q[i].exponential_(generator=gen)
            states[i] = (gen, gen.get_state())
    return (probs / q).argmax(dim=-1), states


def _verify_random(logits: torch.Tensor, row_reqs: Sequence[Request], draft: torch.Tensor,
                   has_draft: torch.Tensor, draft_probs: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of randomly sampling requests → (token if this row decides, draft accepted)."""
    probs = filter_probs(logits, [r.sampling_params for r in row_reqs])
    p_draft = probs.gather(1, draft[:, None]).squeeze(1)
    if draft_probs is None:
        ratio = p_draft                                      # q(x) = 1
        residual = probs.scatter(1, draft[:, None], 0.0)     # max(0, p - one_hot(x))
    else:
        q_draft = draft_probs.gather(1, draft[:, None]).squeeze(1)
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-30), torch.ones_like(p_draft))
        residual = (probs - draft_probs).clamp_min(0.0)
    # The residual is empty only where p equals q, which accepts with probability 1: its token
    # is never read, but keep the row a distribution so the draw stays defined.
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), probs)
    # Bonus rows sample the target itself.
    dist = torch.where(has_draft[:, None], residual, probs)
    uniform = torch.rand_like(p_draft)
    for i, req in enumerate(row_reqs):  # seeded requests draw from their own generators
        gen = request_generator(req, logits.device)
        if gen is not None:
            uniform[i : i + 1].uniform_(generator=gen)
    accepted = (uniform < ratio) & has_draft
    return draw_tokens(dist, row_reqs), accepted
