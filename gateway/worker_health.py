"""When a worker counts as healthy: what one load poll may and may not decide.

A `GetLoad` poll has a short deadline (it feeds routing, so a stale report is worse than none).
On a busy host a live worker can miss it, and taking the worker out for one miss took whole
pools out under a burst. So a miss alone changes nothing until `max_missed_polls` of them in a
row; then, and at once for any other failure (refused, unreachable, draining), the worker's
gRPC health check decides, with a deadline of its own: SERVING keeps the worker in routing (on
its last load report), anything else (NOT_SERVING: loading or draining; no answer) takes it
out until a health check says SERVING again and a poll answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How many load polls in a row may time out before the health check is asked, and that
    check's deadline."""

    max_missed_polls: int = 3
    liveness_timeout_s: float = 5.0

    def tolerates(self, code: grpc.StatusCode, missed_in_a_row: int) -> bool:
        """Whether a failed poll (the `missed_in_a_row`-th) leaves the worker as it was without
        asking its health check: a deadline missed fewer times than the limit (a busy host
        answers late, not never)."""
        return code == grpc.StatusCode.DEADLINE_EXCEEDED and missed_in_a_row < self.max_missed_polls


async def is_serving(channel: grpc.aio.Channel, timeout_s: float) -> bool:
    """Whether the worker's gRPC health check (its whole server: service "") says SERVING within
    `timeout_s`. Health checks need no credential (rpc/auth.py). A peer without the health
    service (UNIMPLEMENTED: not a splitserve worker, e.g. a proxy) is judged by its polls
    alone."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return err.code() == grpc.StatusCode.UNIMPLEMENTED
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
