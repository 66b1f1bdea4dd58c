"""Prefix-aware routing under bursts, through the real services on this machine (CPU or GPU):
two prefill workers, one decode worker and the gateway run as processes; `--groups` groups of
`--per-group` requests, each group's prompts sharing a prefix of `--prefix-len` tokens and then
`--suffix-len` tokens of their own, are sent through the gateway's gRPC `Generate` all at once,
in `--rounds` rounds of new prefixes. Reported: the prompt tokens the routed workers found in
their prefix caches (`Usage.cached_tokens` summed over the requests, and the workers' own
counters from GetLoad), against the most a router could reach (every prompt but the first of
each group served its prefix from cache).

`--busy-len N` first gives each routed worker a long prompt, so that the burst is routed while
they are busy: on an idle small CPU machine the workers' own CPU work delays the gateway until
each group's first prefill has answered, which hides routing differences.

`--colocated`: two decode workers that compute prompts themselves (the gateway's `--colocated`
mode) instead of two prefill workers and a decode worker: the decode workers' routing.

`--gateway-pythonpath DIR` runs the gateway from another tree (an A/B of routing code against
the same workers).

Usage: PYTHONPATH=. python3 tools/probes/probe_prefix_routing.py --out F [--groups 4] [--per-group 6]
       [--prefix-len 256] [--suffix-len 16] [--rounds 2] [--model M] [--gateway-pythonpath DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from bench.results import git_info
from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from rpc.auth import INTERNAL_TOKEN_ENV, bearer_metadata
from tools.probes.probe_disagg import HOST, free_port, spawn_worker, stop_processes, wait_ready


async def _generate(stub: Any, prompt: list[int]) -> int:
    """One request through the gateway; its prompt tokens served from a prefix cache."""
    req = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    cached = None
    async for resp in stub.Generate(req):
        kind = resp.WhichOneof("response")
        if kind == "complete":
            cached = resp.complete.usage.cached_tokens
        elif kind == "error":
            raise RuntimeError(resp.error.message)
    if cached is None:
        raise RuntimeError("the stream ended without a completion")
    return int(cached)


def _stub(channel: grpc.aio.Channel, colocated: bool) -> Any:
    """The routed workers' service: Decode for colocated workers, else Prefill."""
    return (decode_pb2_grpc.DecodeStub if colocated else prefill_pb2_grpc.PrefillStub)(channel)


async def _worker_counters(addresses: list[str], md: tuple[tuple[str, str], ...],
                           colocated: bool) -> dict[str, tuple[int, int]]:
    """Per routed worker: (prompt tokens looked up in its prefix cache, tokens found)."""
    out = {}
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as ch:
            r = await _stub(ch, colocated).GetLoad(common_pb2.LoadRequest(), metadata=md)
            out[address] = (r.prefix_cache_queries, r.prefix_cache_hits)
    return out


async def _run(args: argparse.Namespace, grpc_port: int, workers: list[str],
               md: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    vocab = args.vocab
    rng = random.Random(0)
    rounds = []
    async with grpc.aio.insecure_channel(f"{HOST}:{grpc_port}") as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        # Warm-up: one request per worker's first steps (not counted).
        await asyncio.gather(*(_generate(stub, [rng.randrange(vocab) for _ in range(64)])
                               for _ in range(2)))
        for r in range(args.rounds):
            before = await _worker_counters(workers, md, args.colocated)
            prompts = []
            for _ in range(args.groups):
                prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
                prompts += [prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)]
                            for _ in range(args.per_group)]
            rng.shuffle(prompts)  # groups interleaved, as independent users would send them
            # Busy workers first (one long prompt each, by load): the burst is then routed
            # while none of its prefills can have answered, as on a loaded cluster.
            busy = [asyncio.ensure_future(_generate(
                stub, [rng.randrange(vocab) for _ in range(args.busy_len)]))
                for _ in range(2 if args.busy_len else 0)]
            await asyncio.sleep(args.busy_lead_s if busy else 0.0)
            t0 = time.perf_counter()
            cached = await asyncio.gather(*(_generate(stub, p) for p in prompts))
            wall = time.perf_counter() - t0
            await asyncio.gather(*busy)
            after = await _worker_counters(workers, md, args.colocated)
            per_worker = {a: {"queried (busy prompts included)": after[a][0] - before[a][0],
                              "hit": after[a][1] - before[a][1]} for a in workers}
            reachable = args.groups * (args.per_group - 1) * (
                args.prefix_len // args.block_size * args.block_size)
            rounds.append({"round": r, "wall_s": round(wall, 2),
                           "cached_tokens": sum(cached), "reachable_cached_tokens": reachable,
                           "requests_with_a_hit": sum(c > 0 for c in cached),
                           "workers": per_worker})
            print(json.dumps(rounds[-1]), flush=True)
    return {"rounds": rounds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="the workers' --model (default: SmolLM2)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy-len", type=int, default=0,
                   help="before each burst, one prompt of this many tokens per routed worker "
                        "(0: none; the burst then meets idle workers)")
    p.add_argument("--busy-lead-s", type=float, default=0.5,
                   help="how long the busy prompts run before the burst is sent")
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size")
    p.add_argument("--vocab", type=int, default=32000,
                   help="prompt token ids are drawn below this (SmolLM2 has 49,152)")
    p.add_argument("--cpu-threads", type=int, default=1, help="each worker's, on a CPU")
    p.add_argument("--colocated", action="store_true",
                   help="two decode workers computing prompts (no prefill workers)")
    p.add_argument("--gateway-pythonpath", default=None,
                   help="run the gateway from this tree (default: this one)")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    args = p.parse_args()

    token = secrets.token_hex(16)
    md = bearer_metadata(token)
    log_dir = Path(args.out).parent
    log_dir.mkdir(parents=True, exist_ok=True)
    engine = ["--block-size", str(args.block_size), "--cpu-threads", str(args.cpu_threads)]
    if args.model:
        engine += ["--model", args.model]
    routed = ("decode0", "decode1") if args.colocated else ("prefill0", "prefill1")
    ports = {name: free_port() for name in (*routed, *(() if args.colocated else ("decode",)))}
    procs = {name: spawn_worker(name.rstrip("01"), port, engine, log_dir / f"{name}.log", token)
             for name, port in ports.items()}
    workers = [f"{HOST}:{ports[name]}" for name in routed]  # the workers the router chooses
    rest_port, grpc_port = free_port(), free_port()
    env = {**os.environ, INTERNAL_TOKEN_ENV: token}
    if args.gateway_pythonpath:
        env["PYTHONPATH"] = args.gateway_pythonpath
    gateway_cmd = [sys.executable, "-m", "splitserve", "serve", "--role", "gateway",
                   "--host", HOST, "--port", str(rest_port), "--grpc-port", str(grpc_port),
                   *(["--colocated", "--decode", ",".join(workers)] if args.colocated else
                     ["--prefill", ",".join(workers), "--decode", f"{HOST}:{ports['decode']}"])]
    if args.model:
        gateway_cmd += ["--model", args.model]
    # `python -m` puts the working directory first on sys.path: the other tree's, or it would
    # import this one's gateway whatever PYTHONPATH says.
    procs["gateway"] = subprocess.Popen(gateway_cmd, stdout=(log_dir / "gateway.log").open("wb"),
                                        stderr=subprocess.STDOUT, env=env,
                                        cwd=args.gateway_pythonpath)
    try:
        async def ready() -> None:
            for address, name in zip(workers, routed, strict=True):
                async with grpc.aio.insecure_channel(address) as ch:
                    await wait_ready(_stub(ch, args.colocated), md, procs[name],
                                     args.ready_timeout_s)
            async with grpc.aio.insecure_channel(workers[0]) as ch:
                load = await _stub(ch, args.colocated).GetLoad(common_pb2.LoadRequest(),
                                                               metadata=md)
            deadline = time.monotonic() + args.ready_timeout_s
            while time.monotonic() < deadline:  # the gateway answers once it saw the workers
                if procs["gateway"].poll() is not None:
                    raise RuntimeError("the gateway exited")
                try:
                    async with grpc.aio.insecure_channel(f"{HOST}:{grpc_port}") as ch:
                        await _generate(gateway_pb2_grpc.GatewayStub(ch), [1, 2, 3])
                    break
                except (grpc.aio.AioRpcError, RuntimeError):
                    await asyncio.sleep(1.0)
            else:
                raise RuntimeError("the gateway did not answer in time")
            if load.block_size != args.block_size:
                raise RuntimeError(f"the workers' blocks are {load.block_size} tokens")

        asyncio.run(ready())
        results = asyncio.run(_run(args, grpc_port, workers, md))
    finally:
        stop_processes(procs.values())
    doc = {**git_info(), "gateway_pythonpath": args.gateway_pythonpath,
           "gateway_commit": subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
               cwd=args.gateway_pythonpath).stdout.strip() or None,
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, **results,
           "command": "PYTHONPATH=. python3 tools/probes/probe_prefix_routing.py " + " ".join(
               f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
               for k, v in vars(args).items() if k != "out" and v is not None and v is not False)}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
