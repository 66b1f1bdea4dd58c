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
