"""Disaggregated prefill and decode on one GPU, through the real services (no gateway): a
prefill worker and a decode worker run as processes (`splitserve serve --role ...`), and this
client does what the gateway's orchestrator does: `Prefill` (first token + KV handle), then
`Decode` with the handle (the decode worker pulls the KV over gRPC, then decodes).

The same decode worker, called without a handle, computes the prompt itself: that is the
colocated baseline (prefill chunks and decodes share its steps).

Per request: TTFT (disaggregated: the Prefill call; colocated: the first Decode chunk), the
pull-and-first-step time (Decode call to its first chunk after a prefill), TPOT over the
decode stream's tokens, and whether the KV was recomputed instead of transferred. Greedy,
EOS ignored; warm-up requests use other prompts (no prefix-cache hits).

`--age N` first sends N disaggregated requests of random prompt (a quarter of `--input-len` to
all of it) and output (16 to 4 × `--output-len`) lengths, `--age-concurrency` at a time, so
that the workers' KV pools have lived a while before the measured rounds (a long-lived decode
worker's free blocks are scattered unless the pool keeps runs: tools/probes/probe_block_runs.py).

Usage: PYTHONPATH=. python3 tools/probes/probe_disagg.py --out F [--model dummy:llama-3.1-8b]
       [--concurrency 1,16] [--input-len 2000] [--output-len 128] [--age 800]
       [--block-allocation lru|runs] [--decode-num-gpu-blocks 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from bench.results import git_info
from engine.config import BLOCK_ALLOCATIONS
from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from rpc.auth import INTERNAL_TOKEN_ENV, bearer_metadata

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def spawn_worker(role: str, port: int, engine_args: list[str], log: Path, token: str,
                 visible_devices: str = "") -> subprocess.Popen[bytes]:
    env = {**os.environ, INTERNAL_TOKEN_ENV: token}
    if visible_devices:  # physical GPU indices; the worker's engine runs on the first
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    return subprocess.Popen(
        [sys.executable, "-m", "splitserve", "serve", "--role", role, "--host", HOST,
         "--port", str(port), *engine_args],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def stop_processes(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Terminate, give each 30 s to exit, then kill."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def wait_ready(stub: Any, md: tuple[tuple[str, str], ...], proc: subprocess.Popen[bytes],
                     timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}")
        try:
            await stub.GetLoad(common_pb2.LoadRequest(), metadata=md, timeout=5)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(1.0)
    raise RuntimeError("worker not ready in time")


async def _one(i: int, tag: str, prompt: list[int], output_len: int, disagg: bool,
               prefill: Any, decode: Any, md: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len,
                                         ignore_eos=True)
    rid = f"{tag}-{i}"
    t0 = time.perf_counter()
    times: list[float] = []
    req = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                   num_speculative_tokens=0)
    ttft = None
    if disagg:
        pre = await prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling), metadata=md)
        ttft = time.perf_counter() - t0
        times.append(time.perf_counter())
        req.output_token_ids.append(pre.first_token_id)
        req.kv_handle.CopyFrom(pre.kv_handle)
    t_decode = time.perf_counter()
    first_chunk = None
    recomputed = None
    async for resp in decode.Decode(req, metadata=md):
        kind = resp.WhichOneof("response")
        now = time.perf_counter()
        if kind == "chunk":
            if first_chunk is None:
                first_chunk = now - t_decode
            times.extend([now] * len(resp.chunk.token_ids))
        elif kind == "complete":
            recomputed = resp.complete.kv_recomputed
        else:
            raise RuntimeError(f"{rid}: {resp.error}")
    if ttft is None:
        ttft = times[0] - t0
    # Over the decode stream's tokens (a disaggregated request's first token came from Prefill).
    stream = times[1:] if disagg else times
    tpot = (stream[-1] - stream[0]) / (len(stream) - 1) if len(stream) > 1 else None
    return {"ttft_s": ttft, "decode_first_chunk_s": first_chunk, "tpot_s": tpot,
            "tokens": len(times), "kv_recomputed": recomputed}


def _summary(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    def ms(key: str, q: str) -> float | None:
        vals = sorted(r[key] for r in rows if r[key] is not None)
        if not vals:
            return None
        v = statistics.median(vals) if q == "median" else vals[min(len(vals) - 1,
                                                                    int(0.99 * len(vals)))]
        return round(v * 1e3, 2)
    return {"requests": len(rows), "wall_s": round(wall, 3),
            "output_tok_s": round(sum(r["tokens"] for r in rows) / wall, 1),
            "ttft_ms_median": ms("ttft_s", "median"), "ttft_ms_p99": ms("ttft_s", "p99"),
            "decode_first_chunk_ms_median": ms("decode_first_chunk_s", "median"),
            "tpot_ms_median": ms("tpot_s", "median"), "tpot_ms_p99": ms("tpot_s", "p99"),
            "kv_recomputed": sum(bool(r["kv_recomputed"]) for r in rows)}


async def _pulls(decode: decode_pb2_grpc.DecodeStub,
                 md: tuple[tuple[str, str], ...]) -> dict[str, tuple[int, float]]:
    """The decode worker's KV pulls so far, per way: (count, seconds)."""
    report = await decode.GetLoad(common_pb2.LoadRequest(), metadata=md)
    return {t.transport: (t.pulls, t.seconds) for t in report.kv_transports}


async def _age(args: argparse.Namespace, prefill: Any, decode: Any,
               md: tuple[tuple[str, str], ...], rng: random.Random) -> dict[str, Any]:
    """`args.age` disaggregated requests of random lengths, `args.age_concurrency` at once."""
    gate = asyncio.Semaphore(args.age_concurrency)

    async def one(i: int) -> dict[str, Any]:
        prompt = [rng.randrange(args.vocab)
                  for _ in range(rng.randint(args.input_len // 4, args.input_len))]
        async with gate:
            return await _one(i, "age", prompt, rng.randint(16, 4 * args.output_len), True,
                              prefill, decode, md)
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(i) for i in range(args.age)))
    return {"requests": len(rows), "wall_s": round(time.perf_counter() - t0, 1),
            "kv_recomputed": sum(bool(r["kv_recomputed"]) for r in rows)}


async def _run(args: argparse.Namespace, token: str, ports: dict[str, int]) -> dict[str, Any]:
    md = bearer_metadata(token)
    async with grpc.aio.insecure_channel(f"{HOST}:{ports['prefill']}") as pch, \
            grpc.aio.insecure_channel(f"{HOST}:{ports['decode']}") as dch:
        prefill = prefill_pb2_grpc.PrefillStub(pch)
        decode = decode_pb2_grpc.DecodeStub(dch)
        rng = random.Random(0)
        out: dict[str, Any] = {}
        if args.age:
            out["age"] = await _age(args, prefill, decode, md, rng)
            print("age", json.dumps(out["age"]), flush=True)
        levels = [int(x) for x in args.concurrency.split(",")]
        for k, c in enumerate(levels):
            # A level given more than once is measured as many rounds: c1, c1_2, c1_3, ...
            nth = levels[:k + 1].count(c)
            level = f"c{c}" + (f"_{nth}" if nth > 1 else "")
            for mode in ("disaggregated", "colocated"):
                # Warm-up on other prompts (no prefix-cache hits for the measured ones).
                warm = [[rng.randrange(args.vocab) for _ in range(args.input_len)]
                        for _ in range(min(c, 4))]
                await asyncio.gather(*(_one(i, f"w{mode}{level}", p, 4, mode == "disaggregated",
                                            prefill, decode, md) for i, p in enumerate(warm)))
                prompts = [[rng.randrange(args.vocab) for _ in range(args.input_len)]
                           for _ in range(c)]
                before = await _pulls(decode, md)
                t0 = time.perf_counter()
                rows = await asyncio.gather(*(
                    _one(i, f"{mode}{level}", p, args.output_len, mode == "disaggregated",
                         prefill, decode, md) for i, p in enumerate(prompts)))
                key = f"{mode}_{level}"
                out[key] = _summary(list(rows), time.perf_counter() - t0)
                after = await _pulls(decode, md)
                for way, (n, sec) in after.items():
                    n0, sec0 = before.get(way, (0, 0.0))
                    if n > n0:  # the decode worker's own timing of its loads (start to done)
                        out[key][f"kv_pull_ms_mean_{way}"] = round(
                            (sec - sec0) / (n - n0) * 1e3, 2)
                print(f"{mode} {level}", json.dumps(out[key]), flush=True)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--input-len", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--log-dir", default=None, help="where the workers' logs go (default: "
                   "next to --out)")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    p.add_argument("--kv-transports", default="ipc,tcp,shm,stream",
                   help="the decode worker's --kv-transports (e.g. shm: no CUDA IPC)")
    p.add_argument("--kv-tcp-streams", type=int, default=None,
                   help="the decode worker's --kv-tcp-streams (default: its own)")
    p.add_argument("--age", type=int, default=0,
                   help="requests of random lengths sent first (the module docstring)")
    p.add_argument("--age-concurrency", type=int, default=32)
    p.add_argument("--block-allocation", default=None, choices=BLOCK_ALLOCATIONS,
                   help="both workers' --block-allocation (default: their own)")
    p.add_argument("--decode-num-gpu-blocks", type=int, default=None,
                   help="the decode worker's --num-gpu-blocks (default: from memory)")
    p.add_argument("--prefill-gpus", default="",
                   help="CUDA_VISIBLE_DEVICES of the prefill worker (default: inherited)")
    p.add_argument("--decode-gpus", default="",
                   help="CUDA_VISIBLE_DEVICES of the decode worker, e.g. 1,0: its engine on GPU "
                        "1, the prefill worker's GPU 0 visible for a peer CUDA IPC pull")
    args = p.parse_args()
    token = secrets.token_hex(16)
    log_dir = Path(args.log_dir or Path(args.out).parent)
    log_dir.mkdir(parents=True, exist_ok=True)
    engine_args = ["--model", args.model, "--max-model-len", str(args.max_model_len),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.block_allocation:
        engine_args += ["--block-allocation", args.block_allocation]
    ports = {"prefill": free_port(), "decode": free_port()}
    decode_args = [*engine_args, "--kv-transports", args.kv_transports]
    if args.decode_num_gpu_blocks is not None:
        decode_args += ["--num-gpu-blocks", str(args.decode_num_gpu_blocks)]
    if args.kv_tcp_streams is not None:
        decode_args += ["--kv-tcp-streams", str(args.kv_tcp_streams)]
    gpus = {"prefill": args.prefill_gpus, "decode": args.decode_gpus}
    procs = {role: spawn_worker(role, ports[role],
                                decode_args if role == "decode" else engine_args,
                                log_dir / f"{role}.log", token, gpus[role])
             for role in ("prefill", "decode")}
    try:
        async def ready() -> None:
            md = bearer_metadata(token)
            async with grpc.aio.insecure_channel(f"{HOST}:{ports['prefill']}") as pch, \
                    grpc.aio.insecure_channel(f"{HOST}:{ports['decode']}") as dch:
                await wait_ready(prefill_pb2_grpc.PrefillStub(pch), md, procs["prefill"],
                                 args.ready_timeout_s)
                await wait_ready(decode_pb2_grpc.DecodeStub(dch), md, procs["decode"],
                                 args.ready_timeout_s)

        t = time.perf_counter()
        asyncio.run(ready())
        start_s = time.perf_counter() - t
        results = asyncio.run(_run(args, token, ports))
    finally:
        stop_processes(procs.values())
    # What the workers logged about the KV handoff: which way it came, and any errors (a load
    # that failed is recomputed by the decode worker, which would void the comparison).
    worker_log = {role: [line.strip() for line in (log_dir / f"{role}.log").read_text(
        errors="replace").splitlines() if "KV from" in line or " ERROR " in line][:20]
        for role in ("prefill", "decode")}
    doc = {"model": args.model, "input_len": args.input_len, "output_len": args.output_len,
           "worker_log": worker_log,
           "gpu_memory_utilization_each": args.gpu_memory_utilization, "start_s": round(start_s, 1),
           "results": results, "git": git_info(),
           "command": "PYTHONPATH=. python3 tools/probes/probe_disagg.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if k not in ("out", "log_dir"))}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
