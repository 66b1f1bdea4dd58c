"""What a request asks of the engine besides its prompt (torch-free: the services build it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RemoteKv:
    """The KV of the prompt's first `num_tokens` tokens comes from elsewhere: all of them from
    a prefill worker (decode role), or a prefix of full blocks from the CPU/Redis tiers (prefill
    role, worker/tier_cache.py); the engine computes the rest.

    `handle` is opaque to the engine (the service's loader reads it); the engine only needs to
    know how many prompt tokens the KV covers. `cached`: the KV comes from a cache (the tiers),
    so a successful load counts its tokens as cached ones (`Request.num_cached_tokens`), as
    prefix-cache hits are; KV transferred from a prefill worker is not.
    """

    num_tokens: int
    handle: object = None
    cached: bool = False
