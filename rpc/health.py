"""The gRPC health service of every splitserve server: grpc's asyncio HealthServicer with
`List` (grpc.health.v1.Health/List), which grpcio-health-checking leaves unimplemented (a
client calling it got UNIMPLEMENTED and the server logged a traceback)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

# The protocol lets a server refuse a List of more services than it wants to answer at once
# (RESOURCE_EXHAUSTED); ours register a handful.
MAX_LISTED_SERVICES = 100


class HealthServicer(health.aio.HealthServicer):
    """Check, Watch and List over the statuses `set` records."""

    async def List(self, request: health_pb2.HealthListRequest,
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)  # a snapshot: `set` may run meanwhile
        if len(statuses) > MAX_LISTED_SERVICES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {MAX_LISTED_SERVICES} services")
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in statuses.items()})
