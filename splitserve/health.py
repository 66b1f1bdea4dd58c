"""`splitserve health`: ask a worker's gRPC health service whether it serves, as a probe command.

Kubernetes' native gRPC probes do not speak TLS, so workers bound with mutual TLS
(`SPLITSERVE_TLS_*`, rpc/tls.py) need an exec probe instead; this one dials the way the
services dial each other (TLS from the same variables when they are set) and exits 0 when the
worker answers SERVING, 1 otherwise (NOT_SERVING, unreachable, refused, timed out). Torch-free.

    splitserve health --address 127.0.0.1:50061 [--service NAME] [--timeout 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.tls import TlsConfigError, internal_channel


async def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The worker's status name ("SERVING", "NOT_SERVING", ...) or the gRPC error's code name."""
    async with internal_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:50061", help="the worker's host:port")
    p.add_argument("--service", default="", help="a service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = p.parse_args(argv)
    try:
        status = asyncio.run(check(args.address, args.service, args.timeout))
    except TlsConfigError as e:
        print(f"splitserve health: {e}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1
