"""What a fresh gRPC channel per call costs against a reused one (CPU, loopback).

The decode worker's KV connector opens a channel per call to a prefill worker (the pull's
`PullBlocks*` call, then `Release`), through `rpc.tls.internal_channel`: plaintext, or
mutual TLS when the deployment configures it. This times a unary call (the gRPC health check,
a real server on 127.0.0.1) both ways, plaintext and, with `--tls-dir` holding `ca.pem`,
`leaf.pem` and `leaf.key` (a leaf for "splitserve-internal", client and server use), over
mutual TLS.

Usage: PYTHONPATH=. python3 tools/probes/probe_channel_reuse.py --out F [--tls-dir D] [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.results import git_info
from rpc import tls


async def _measure(calls: int) -> dict[str, Any]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = tls.add_internal_port(server, "127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    request = health_pb2.HealthCheckRequest()
    fresh: list[float] = []
    reused: list[float] = []
    try:
        async with tls.internal_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(request)
            for _ in range(calls):  # alternated, so drift hits both alike
                t = time.perf_counter()
                async with tls.internal_channel(target) as one_off:
                    await health_pb2_grpc.HealthStub(one_off).Check(request)
                fresh.append(time.perf_counter() - t)
                t = time.perf_counter()
                await stub.Check(request)
                reused.append(time.perf_counter() - t)
    finally:
        await server.stop(0)

    def ms(values: list[float]) -> dict[str, float]:
        s = sorted(values)
        return {"median_ms": round(statistics.median(s) * 1e3, 3),
                "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 3)}
    return {"fresh_channel": ms(fresh), "reused_channel": ms(reused)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tls-dir", default=None)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    for name in (tls.TLS_CERT_ENV, tls.TLS_KEY_ENV, tls.TLS_CA_ENV):
        os.environ.pop(name, None)
    rows = {"plaintext": asyncio.run(_measure(args.calls))}
    if args.tls_dir:
        folder = Path(args.tls_dir)
        os.environ.update({tls.TLS_CERT_ENV: str(folder / "leaf.pem"),
                           tls.TLS_KEY_ENV: str(folder / "leaf.key"),
                           tls.TLS_CA_ENV: str(folder / "ca.pem")})
        rows["mutual_tls"] = asyncio.run(_measure(args.calls))
    print(json.dumps(rows))
    doc = {"calls": args.calls, "results": rows, "git": git_info(),
           "command": f"PYTHONPATH=. python3 tools/probes/probe_channel_reuse.py --calls {args.calls}"
                      + (" --tls-dir D" if args.tls_dir else "") + " --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
