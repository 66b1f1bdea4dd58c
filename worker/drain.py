"""Draining a worker for scale-in: refuse new work at once, let the work it holds end.

`DrainGate` is a server interceptor on every worker. It counts the calls in progress (all but
health checks and reflection) and, once `draining` is set (SIGTERM, which a Kubernetes
`preStop` precedes), refuses every new call but the KV transfers with UNAVAILABLE: the gateway
retries those on another worker and takes this one out of routing (its health check already
says NOT_SERVING). KV pulls and lease releases stay open: a prefill worker's leases are
honoured until decode workers pulled them or they expire. `wait_drained` then waits (bounded)
until no call is in progress and no lease is held.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from rpc.auth import HEALTH_METHODS, refusing_handler

KV_TRANSFER_PREFIX = "/splitserve.v1.KvTransfer/"
_REFLECTION_PREFIX = "/grpc.reflection."
DRAINING_MESSAGE = "worker is draining (shutting down): retry on another worker"
# How long SIGTERM waits for calls in progress and leases before cutting them off
# (--drain-timeout; a pod's terminationGracePeriodSeconds must exceed it plus its preStop sleep).
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts calls in progress; refuses new ones (but KV transfers) once `draining`."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # calls in progress, health checks and reflection not counted
        self.started: Counter[str] = Counter()  # calls accepted, by method name ("Decode")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in HEALTH_METHODS or method.startswith(_REFLECTION_PREFIX):
            return handler
        if self.draining and not method.startswith(KV_TRANSFER_PREFIX):
            return refusing_handler(handler, grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        self.started[method.rpartition("/")[2]] += 1
        return self._counted(handler)

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` with `active` raised while it runs (the services use unary requests)."""
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                self.active += 1
                try:
                    return await unary(request, context)
                finally:
                    self.active -= 1

            return grpc.unary_unary_rpc_method_handler(call, **kwargs)
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def call_stream(request: Any, context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[Any]:
                self.active += 1
                try:
                    result = stream(request, context)
                    if inspect.isasyncgen(result):
                        try:
                            async for item in result:
                                yield item
                        finally:
                            await result.aclose()
                    else:  # a handler writing with context.write
                        await result
                finally:
                    self.active -= 1

            return grpc.unary_stream_rpc_method_handler(call_stream, **kwargs)
        return handler  # client streaming: none of the worker services has one


async def wait_drained(gate: DrainGate, leases: Callable[[], int], timeout_s: float,
                       poll_s: float = 0.05) -> bool:
    """Wait until no call is in progress and `leases()` is 0, at most `timeout_s`; whether it
    got there (False: the rest is cut off by the shutdown that follows)."""
    deadline = time.monotonic() + timeout_s
    while gate.active > 0 or leases() > 0:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
