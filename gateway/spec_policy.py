"""The speculative decoding policy: how many drafts per step to ask of a decode worker, from its
load (DESIGN.md §3 step 4).

Each draft is one more query row per sequence in the worker's verify step. On a lightly loaded
worker a decode step is bound by streaming the weights, so the extra rows are nearly free and
every accepted draft is a token without a step of its own: lower inter-token latency. As the
batch grows the step becomes compute-bound, and the rows of rejected drafts slow every request
in the batch. So the gateway asks for `speculative_tokens` drafts while the worker is below
`speculative_max_load` pending requests and turns speculation off (0) from there on.

The decision is made per Decode call, on the worker the router just picked; a resume on another
worker decides again for that worker. The worker still has the last word: it caps the request's
number at its own `--num-speculative-tokens`, and without a speculative method ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.router import Worker


@dataclass(frozen=True, slots=True)
class SpecDecision:
    """What the policy chose for one Decode call, and the load it saw."""

    num_speculative_tokens: int   # DecodeRequest.num_speculative_tokens (0: off)
    load: int                     # requests pending on the worker besides this one

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


def speculative_tokens_for_load(load: int, speculative_tokens: int, max_load: int) -> int:
    """`speculative_tokens` while `load` (pending requests on the worker) is below `max_load`,
    0 at or above it."""
    return speculative_tokens if load < max_load else 0


def worker_load(worker: Worker) -> int:
    """Requests pending on a decode worker besides the one being routed: running + waiting as
    of its last load report, plus the requests routed to it since. `WorkerPool.pick` has already
    counted the request being routed (in `picks_since_poll`), so it is taken off again."""
    pending, _ = worker.routing_key()
    return max(0, pending - 1)


def decide(worker: Worker, config: GatewayConfig) -> SpecDecision:
    """The policy's choice for a Decode call on `worker`, which `WorkerPool.pick` just chose."""
    load = worker_load(worker)
    return SpecDecision(speculative_tokens_for_load(load, config.speculative_tokens,
                                                    config.speculative_max_load), load)
