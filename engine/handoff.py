"""The records of a KV handoff between the engine and the services: a `KvLoad` the scheduler
starts for a request whose KV comes from elsewhere (the service's loader fills its blocks), and
a `Lease` under which a prefill engine holds a finished prompt's KV for a decode worker."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request


@dataclass(slots=True)
class KvLoad:
    """The request's first `num_tokens` prompt tokens have KV elsewhere; fill
    `block_ids` with that KV's blocks `first_block`, `first_block + 1`, ... (the blocks before
    `first_block` were found in this engine's own prefix cache and need no transfer)."""

    request: Request
    block_ids: list[int]
    num_tokens: int
    first_block: int = 0


@dataclass(slots=True)
class Lease:
    """Prefill role: a finished request's prompt KV, held until released or expired."""

    lease_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    deadline: float            # time.monotonic()
