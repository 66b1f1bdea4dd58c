"""Speculative decoding: proposers draft tokens, the target model scores them all in one step,
and the rejection sampler keeps the target's distribution exactly (DESIGN.md §5).

    proposer (after a step, per request)  →  request.spec_token_ids
    scheduler (next step)                 →  1 + len(drafts) query rows for that request
    runner                                →  logits at every row  →  rejection sampler
    scheduler                             →  accepted drafts + one target token appended,
                                             computed tokens rolled back past the rejected ones

The rejected drafts' KV was written into slots past the sequence's end; the next step
overwrites them, and they are never hashed into the prefix cache (only known tokens are).
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    """Drafts up to `k` tokens to follow `token_ids` (called between steps, per request that
    speculates). N-gram lookup is the one built (ngram.py); a draft model plugs in here with its
    own runner, returning its drafts' probabilities to `rejection.verify` as `draft_probs`."""

    def propose(self, token_ids: list[int], k: int) -> list[int]: ...
