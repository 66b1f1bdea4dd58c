"""How fast `splitserve bench online`'s client can take tokens: is an online result the server's
speed or the client's?

A stand-in OpenAI server (FastAPI + uvicorn, in a child process) streams each completion as one
SSE event per token, paced at `--itl-ms` per stream (0: as fast as it can). The real client
(`bench.online.run_online`) reads `--concurrency` streams at once. If the client keeps up, its
median ITL is the server's pacing and its tokens/s is concurrency / ITL; where it falls behind,
ITL grows past the pacing. The child and this process share the machine's cores, so the rates
are a lower bound on a machine with more of them.

Usage: PYTHONPATH=. python3 tools/probes/probe_client.py --out F [--concurrency 1,32,128]
       [--itl-ms 0,5,10] [--tokens 256] [--requests-per-stream 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from bench.online import OnlineSettings, run_online
from bench.results import environment_info
from bench.workloads import BenchRequest


def _app(itl_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        n = int(body["max_tokens"])

        async def stream() -> AsyncIterator[str]:
            for _ in range(n):
                chunk = {"id": "c", "object": "text_completion", "model": "stand-in",
                         "choices": [{"index": 0, "text": " tok", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(itl_s)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                     "total_tokens": len(body["prompt"]) + n}
            yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def serve(port: int, itl_ms: float) -> None:
    uvicorn.run(_app(itl_ms / 1e3), host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the stand-in server exited")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the stand-in server did not start")


def measure(port: int, concurrency: int, tokens: int, per_stream: int) -> dict[str, Any]:
    reqs = [BenchRequest([1, 2, 3], tokens) for _ in range(concurrency * per_stream)]
    settings = OnlineSettings(base_url=f"http://127.0.0.1:{port}", max_concurrency=concurrency)
    records, duration, _ = asyncio.run(run_online(settings, reqs, [0.0] * len(reqs)))
    failed = [r for r in records if not r.success]
    itls = [b - a for r in records
            for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    total = sum(r.output_len for r in records if r.success)
    return {"concurrency": concurrency, "requests": len(reqs), "failed": len(failed),
            "output_tok_s": round(total / duration, 1), "duration_s": round(duration, 3),
            "itl_ms_median": round(statistics.median(itls) * 1e3, 3) if itls else None,
            "itl_ms_p99": round(sorted(itls)[int(0.99 * (len(itls) - 1))] * 1e3, 3)
            if itls else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--itl-ms", default="0,5,10")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--serve", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        serve(args.port, args.serve)
        return 0
    rows = []
    for itl_ms in (float(x) for x in args.itl_ms.split(",")):
        port = _free_port()
        child = subprocess.Popen([sys.executable, sys.argv[0], "--serve", str(itl_ms),
                                  "--port", str(port)], env={**os.environ})
        try:
            _wait(port, child)
            for c in (int(x) for x in args.concurrency.split(",")):
                row = {"server_itl_ms": itl_ms,
                       **measure(port, c, args.tokens, args.requests_per_stream)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            child.terminate()
            child.wait(timeout=30)
    doc = {"probe": "bench_client", "command": " ".join(["python3", *sys.argv]),
           "environment": environment_info(), "tokens_per_request": args.tokens, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
