"""A Decode stream's watchdog: a worker that stops answering mid-stream is abandoned.

A worker that is stopped rather than dead (SIGSTOP, a frozen host, a hung runtime) keeps its TCP
connections open, so its streams would wait for it until the request's deadline. The stream's
reads are watched instead: after `stall_s` without a message, the worker's gRPC health check is
asked (its deadline: the gateway's `liveness_timeout_s`). A worker that answers SERVING is busy
(a long prompt, a KV pull, a full batch): the stream waits on. One that does not answer in time,
or that the pool's polls already took out of routing, is abandoned: `WorkerStalled`, which the
orchestrator treats as the worker's death (the stream resumes elsewhere from its last sent
token). A stream is thus cut at most `stall_s` + `liveness_timeout_s` after its worker stopped.

`stall_s` scales with the worker's measured step time (its load report's step costs): a slow
model's pauses between tokens are not mistaken for a stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from gateway.router import Worker
from gateway.worker_health import is_serving
from protos.splitserve.v1 import common_pb2

# A stream may go this many of its worker's decode steps without a token before its worker's
# health is asked (a preemption, a queue ahead of it and a KV pull all take several steps).
STALL_STEPS = 50


class WorkerStalled(Exception):
    """The worker of a stream stopped answering (no message, and no health answer, in time)."""

    def __init__(self, address: str, silent_s: float) -> None:
        super().__init__(f"worker {address} stopped answering ({silent_s:.1f}s without a "
                         f"token or a health answer)")
        self.address = address


class _Stream(Protocol):
    async def read(self) -> Any: ...


def stall_after_s(report: common_pb2.LoadReport, floor_s: float) -> float:
    """Seconds without a message before a stream's worker is asked whether it lives: its
    one-row decode step time (measured, in its load report) times STALL_STEPS, at least
    `floor_s`."""
    costs = [c.seconds for c in report.spec_step_cost if c.seconds > 0]
    return max(floor_s, STALL_STEPS * min(costs)) if costs else floor_s


async def watched(call: _Stream, worker: Worker, stall_s: float,
                  liveness_timeout_s: float) -> AsyncIterator[Any]:
    """`call`'s messages until its end; raises `WorkerStalled` when its worker stopped
    answering. The read in progress is cancelled on every way out (the call with it)."""
    loop = asyncio.get_running_loop()
    while True:
        read = asyncio.ensure_future(call.read())
        silent_since = loop.time()
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=stall_s)
                if done:
                    break
                alive = worker.healthy and await is_serving(worker.channel, liveness_timeout_s)
                if read.done():  # it answered meanwhile: whatever the health check said
                    break
                if not alive:
                    raise WorkerStalled(worker.address, loop.time() - silent_since)
        finally:
            if not read.done():
                read.cancel()
        message = read.result()
        if message is grpc.aio.EOF:
            return
        yield message
