"""A worker call's watchdog: a worker that stops answering mid-call is abandoned.

A worker that is stopped rather than dead (SIGSTOP, a frozen host, a hung runtime) keeps its TCP
connections open, so its calls would wait for it until the request's deadline. A Decode
stream's reads and a Prefill's answer are watched instead: after `stall_s` without one, the
worker's gRPC health check is asked (its deadline: the gateway's `liveness_timeout_s`). A
worker that answers SERVING is busy (a long prompt, a KV pull, a full batch): the call waits
on. One that does not answer in time, or that the pool's polls already took out of routing, is
abandoned: `WorkerStalled`, which the orchestrator treats as the worker's death (a stream
resumes elsewhere from its last sent token; a Prefill's request goes whole to a decode
worker). A call is thus cut at most `stall_s` + `liveness_timeout_s` after its worker stopped.

`stall_s` scales with the worker's measured step time (its load report's step costs): a slow
model's pauses between tokens are not mistaken for a stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

import grpc

from gateway.router import Worker
from gateway.worker_health import is_serving
from protos.splitserve.v1 import common_pb2

# A stream may go this many of its worker's decode steps without a token before its worker's
# health is asked (a preemption, a queue ahead of it and a KV pull all take several steps).
STALL_STEPS = 50
T = TypeVar("T")


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
    costs = [c.seconds for c in report.spec_step_cost if c.seconds > 0 and not c.verify]
    return max(floor_s, STALL_STEPS * min(costs)) if costs else floor_s


async def watched(call: _Stream, worker: Worker, stall_s: float,
                  liveness_timeout_s: float) -> AsyncIterator[Any]:
    """`call`'s messages until its end; raises `WorkerStalled` when its worker stopped
    answering. The read in progress is cancelled on every way out (the call with it)."""
    while True:
        message = await watched_answer(call.read(), worker, stall_s, liveness_timeout_s)
        if message is grpc.aio.EOF:
            return
        yield message


async def watched_answer(answer: Awaitable[T], worker: Worker, stall_s: float,
                         liveness_timeout_s: float) -> T:
    """`answer` (a unary call, a stream's next read) awaited under the watch: `WorkerStalled`
    when, after `stall_s` without it, the worker does not answer its health check in time.
    Cancelled (the call with it) on every way out but its own end."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(answer)
    silent_since = loop.time()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=stall_s)
            if done:
                return task.result()
            alive = worker.healthy and await is_serving(worker.channel, liveness_timeout_s)
            if task.done():  # it answered meanwhile: whatever the health check said
                return task.result()
            if not alive:
                raise WorkerStalled(worker.address, loop.time() - silent_since)
    finally:
        if not task.done():
            task.cancel()
