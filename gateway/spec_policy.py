"""The speculative decoding policy: how many drafts per step to ask of a decode worker, and
from which proposer, by its load (docs/architecture.md, "A request's way through the layers").

Each draft is one more query row per sequence in the worker's verify step. On a lightly loaded
worker a decode step is bound by streaming the weights, so the extra rows are nearly free and
every accepted draft is a token without a step of its own: lower inter-token latency. As the
batch grows the step becomes compute-bound, and the rows of rejected drafts slow every request
in the batch. So the gateway asks for `speculative_tokens` drafts while the worker is below
`speculative_max_load` pending requests and turns speculation off (0) from there on.

Which proposer: a worker with a draft model (it reports its methods in its load report) drafts
with it below `speculative_draft_max_load` pending requests, where its k extra model steps per
round are cheap next to the target's; from there on with n-gram prompt lookup, whose drafts cost
no model step at all (only where the text repeats). A worker with n-gram lookup only gets
n-gram; one that has not reported yet gets its own default (UNSPECIFIED).

The decision is made per Decode call, on the worker the router just picked; a resume on another
worker decides again for that worker. The worker still has the last word: it caps the request's
number at its own `--num-speculative-tokens`, and without a speculative method ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from gateway.config import GatewayConfig
from gateway.router import Worker
from protos.splitserve.v1 import common_pb2

_LABELS: dict[int, str] = {common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL: "draft_model",
                           common_pb2.SPECULATIVE_METHOD_NGRAM: "ngram",
                           common_pb2.SPECULATIVE_METHOD_UNSPECIFIED: "default"}
Method: TypeAlias = common_pb2.SpeculativeMethod.ValueType


@dataclass(frozen=True, slots=True)
class SpecDecision:
    """What the policy chose for one Decode call, and the load it saw."""

    num_speculative_tokens: int   # DecodeRequest.num_speculative_tokens (0: off)
    load: int                     # requests pending on the worker besides this one
    method: Method = common_pb2.SPECULATIVE_METHOD_UNSPECIFIED  # DecodeRequest.speculative_method

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def label(self) -> str:
        """The metrics label: "off", or the proposer asked for ("default": the worker's own)."""
        return _LABELS.get(int(self.method), "default") if self.enabled else "off"


def speculative_tokens_for_load(load: int, speculative_tokens: int, max_load: int) -> int:
    """`speculative_tokens` while `load` (pending requests on the worker) is below `max_load`,
    0 at or above it."""
    return speculative_tokens if load < max_load else 0


def worker_load(worker: Worker) -> int:
    """Requests pending on a decode worker besides the one being routed (`Worker.routing_key`:
    this gateway's in flight there plus the others of its last load report). `WorkerPool.pick`
    has already counted the request being routed (in `in_flight`), so it is taken off again."""
    pending, _ = worker.routing_key()
    return max(0, pending - 1)


def method_for_load(load: int, methods: Sequence[Method], draft_max_load: int) -> Method:
    """The proposer to ask for: the draft model below `draft_max_load` if the worker has one,
    else n-gram lookup if it has it, else UNSPECIFIED (the worker's own; `methods` empty: it
    has not reported any, or has none and ignores the request's drafts anyway)."""
    if load < draft_max_load and common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL in methods:
        return common_pb2.SPECULATIVE_METHOD_DRAFT_MODEL
    if common_pb2.SPECULATIVE_METHOD_NGRAM in methods:
        return common_pb2.SPECULATIVE_METHOD_NGRAM
    return common_pb2.SPECULATIVE_METHOD_UNSPECIFIED


def decide(worker: Worker, config: GatewayConfig) -> SpecDecision:
    """The policy's choice for a Decode call on `worker`, which `WorkerPool.pick` just chose."""
    load = worker_load(worker)
    tokens = speculative_tokens_for_load(load, config.speculative_tokens,
                                         config.speculative_max_load)
    if not tokens:
        return SpecDecision(0, load)
    return SpecDecision(tokens, load, method_for_load(
        load, list(worker.load.speculative_methods), config.speculative_draft_max_load))
