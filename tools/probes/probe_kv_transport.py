"""KV handoff between two processes on one GPU, by transport: CUDA IPC, shared memory, the KV
data port (raw TCP), gRPC stream.

A child process plays the prefill worker's KV side: a KV cache of Llama-3.1-8B's block shape
(32 layers, 8 KV heads, head_dim 128, 16 tokens: 2 MB per bf16 block) filled from a seed,
leases over random blocks of it, and the real `KvTransferServicer` (with the cache offered for
CUDA IPC, as a prefill worker on a GPU offers it). This process pulls each lease with the real
`GrpcPullConnector` into a second cache on the same GPU, one transport at a time, and checks
every pulled block bit for bit against the same seeded cache rebuilt here.

Usage (on the GPU machine): PYTHONPATH=. python3 tools/probes/probe_kv_transport.py --out F
    [--blocks 16,64,256] [--repeats 5] [--kv-dtype bf16|fp8] [--transports ipc,tcp,shm,stream]
On a machine without a GPU, `--device cpu` runs the host transports (shared memory, TCP, the
gRPC stream) between two CPU caches: what the stream's encoding, messages and decoding cost.
TCP runs over loopback here; between hosts the network's rate caps it as well.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import grpc
import torch

from bench.results import environment_info
from engine.dma_copy import dma_available
from engine.runner.block_io import copy_cache_blocks
from engine_api.hashing import HASH_BYTES
from kv_transfer import DEFAULT_TCP_STREAMS
from kv_transfer.connector import GrpcPullConnector
from kv_transfer.handle import KvHandle
from kv_transfer.protocol import channel_options
from kv_transfer.servicer import KvTransferServicer, LeaseView
from kv_transfer.tcp import KvDataServer
from kv_transfer.wire import BlockSpec
from protos.splitserve.v1 import kv_transfer_pb2_grpc

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SRC_BLOCKS, DST_BLOCKS = 1024, 512
FINGERPRINT = b"\x01" * 32
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
_PEER_ENV = "SPLITSERVE_PROBE_PEER"


def spec_for(dtype: torch.dtype) -> BlockSpec:
    return BlockSpec(fingerprint=FINGERPRINT, num_layers=NUM_LAYERS, block_size=BLOCK_SIZE,
                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)


def seeded_cache(num_blocks: int, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """The same values in every process of this device for the same arguments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                        generator=gen, device=device, dtype=torch.bfloat16)
    return cache.to(dtype)


def leases(sizes: list[int], repeats: int, transports: list[str]) -> dict[str, list[int]]:
    """request id → the source blocks of its lease (random, seeded: both processes agree)."""
    gen = torch.Generator().manual_seed(1)
    out: dict[str, list[int]] = {}
    for t in transports:
        for n in sizes:
            for r in range(repeats + 1):  # the first of each is a warm-up
                out[f"{t}-{n}-{r}"] = torch.randperm(SRC_BLOCKS, generator=gen)[:n].tolist()
    return out


def block_hashes(n: int) -> list[bytes]:
    return [bytes([1 + i % 250]) * HASH_BYTES for i in range(n)]  # never all zero (wire.py)


class Source:
    """`KvBlockSource` over the seeded cache: fixed leases, never expiring."""

    def __init__(self, cache: torch.Tensor, spec: BlockSpec, table: dict[str, list[int]]) -> None:
        self._cache, self._spec, self._table = cache, spec, table

    @property
    def spec(self) -> BlockSpec:
        return self._spec

    def lookup(self, request_id: str) -> LeaseView | None:
        ids = self._table.get(request_id)
        if ids is None:
            return None
        return LeaseView(list(ids), block_hashes(len(ids)), len(ids) * BLOCK_SIZE)

    async def read_block(self, block_id: int) -> torch.Tensor:
        return (await self.read_blocks([block_id]))[0]

    async def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        def read() -> torch.Tensor:
            idx = torch.tensor(block_ids, device=self._cache.device)
            raw = self._cache.view(torch.uint8).index_select(2, idx).permute(2, 0, 1, 3, 4, 5)
            return raw.cpu().contiguous().view(self._cache.dtype)
        return await asyncio.to_thread(read)

    def release(self, request_id: str) -> bool:
        return request_id in self._table


class Sink:
    """`DeviceKvBlockSink` over a cache on this process's device."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache = cache
        self._stream = torch.cuda.Stream() if cache.is_cuda else None

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def write_blocks(self, block_ids: list[int], tensors: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, device=self.cache.device)
        src = tensors.view(torch.uint8).to(self.cache.device).permute(1, 2, 0, 3, 4, 5)
        self.cache.view(torch.uint8).index_copy_(2, idx, src)
        if self.cache.is_cuda:
            torch.cuda.synchronize()

    def copy_blocks_from(self, block_ids: list[int], src_cache: torch.Tensor,
                         src_block_ids: list[int]) -> None:
        # As the engine's runner does: by copy engine when both caches are on this GPU.
        dma = src_cache.device == self.cache.device and self.cache.is_cuda and dma_available()
        copy_cache_blocks(self.cache, block_ids, src_cache, src_block_ids, self._stream,
                          dma_streams=[self._stream] if dma and self._stream else ())


async def serve(args: argparse.Namespace) -> None:
    dtype = DTYPES[args.kv_dtype]
    spec = spec_for(dtype)
    cache = seeded_cache(SRC_BLOCKS, dtype, seed=0, device=args.device)
    table = leases(_sizes(args), args.repeats, _transports(args))
    server = grpc.aio.server(options=channel_options())
    source = Source(cache, spec, table)
    data = KvDataServer(source, asyncio.get_running_loop(), "127.0.0.1")
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(
        KvTransferServicer(source, ipc_cache=cache if cache.is_cuda else None,
                           data_server=data), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await server.wait_for_termination()


async def pull(args: argparse.Namespace, port: int) -> dict[str, Any]:
    dtype = DTYPES[args.kv_dtype]
    spec = spec_for(dtype)
    expected = seeded_cache(SRC_BLOCKS, dtype, seed=0, device=args.device).view(torch.uint8)
    table = leases(_sizes(args), args.repeats, _transports(args))
    results: dict[str, Any] = {}
    for transport in _transports(args):
        sink = Sink(torch.zeros(NUM_LAYERS, 2, DST_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                device=args.device, dtype=dtype))
        connector = GrpcPullConnector(spec, sink, asyncio.get_running_loop(), timeout_s=120,
                                      use_ipc=transport == "ipc", use_shm=transport == "shm",
                                      use_tcp=transport == "tcp", tcp_streams=args.tcp_streams)
        for n in _sizes(args):
            times, exact = [], True
            for r in range(args.repeats + 1):
                rid = f"{transport}-{n}-{r}"
                dst_ids = torch.randperm(DST_BLOCKS)[:n].tolist()
                handle = KvHandle(f"127.0.0.1:{port}", rid, n * BLOCK_SIZE, n, FINGERPRINT,
                                  BLOCK_SIZE, tuple(block_hashes(n)))
                t0 = time.perf_counter()
                await asyncio.to_thread(connector.start_load_kv, rid, handle, dst_ids)
                result = await connector.wait_for_load(rid)
                dt = time.perf_counter() - t0
                connector.get_finished_loads()
                if not result.ok:
                    raise RuntimeError(f"{rid}: {result.reason}")
                src_idx = torch.tensor(table[rid], device=args.device)
                dst_idx = torch.tensor(dst_ids, device=args.device)
                exact &= bool(torch.equal(sink.cache.view(torch.uint8).index_select(2, dst_idx),
                                          expected.index_select(2, src_idx)))
                if r:
                    times.append(dt)
            nbytes = n * spec.block_nbytes
            med = statistics.median(times)
            results[f"{transport}_{n}"] = {
                "blocks": n, "bytes": nbytes, "exact": exact,
                "ms_median": round(med * 1e3, 3), "ms_all": [round(t * 1e3, 3) for t in times],
                "gb_s": round(nbytes / med / 1e9, 2),
                "used": _used(connector, transport, port)}
            print(transport, n, json.dumps(results[f"{transport}_{n}"]), flush=True)
    return results


def _used(connector: GrpcPullConnector, transport: str, port: int) -> str:
    """Which way the pulls went (a refused way is remembered per worker address)."""
    address = f"127.0.0.1:{port}"
    refused = {"ipc": connector._no_ipc, "shm": connector._no_shm, "tcp": connector._no_tcp}
    return transport if address not in refused.get(transport, {address}) else "stream"


def _sizes(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.blocks.split(",")]


def _transports(args: argparse.Namespace) -> list[str]:
    if args.transports:
        return args.transports.split(",")
    return ["ipc", "tcp", "shm", "stream"] if args.device == "cuda" else ["tcp", "shm", "stream"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--blocks", default="16,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transports", default="",
                   help="comma list of ipc,tcp,shm,stream, each measured alone (default: all the "
                        "device allows)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tcp-streams", type=int, default=DEFAULT_TCP_STREAMS,
                   help="connections one data-port pull opens at once")
    p.add_argument("--peer", action="store_true",
                   help="the puller on another GPU than the prefill side (2 GPUs): the serving "
                        "child sees GPU 0, the pulling process GPUs 1,0")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer and not args.serve and os.environ.get(_PEER_ENV) != "1":
        # CUDA_VISIBLE_DEVICES must be set before CUDA starts: run again under it.
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1,0", _PEER_ENV: "1"}
        return subprocess.call([sys.executable, *sys.argv], env=env)
    if args.serve:
        asyncio.run(serve(args))
        return 0
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.peer:
        child_env["CUDA_VISIBLE_DEVICES"] = "0"
    child = subprocess.Popen([sys.executable, *sys.argv, "--serve"], stdout=subprocess.PIPE,
                             env=child_env)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().decode()
        if not line.startswith("PORT "):
            raise RuntimeError(f"server did not start: {line!r}")
        results = asyncio.run(pull(args, int(line.split()[1])))
    finally:
        child.terminate()
        child.wait(timeout=30)
    doc = {"probe": "kv_transport", "command": " ".join(["python3", *sys.argv]),
           "peer": args.peer, "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
           "tcp_streams": args.tcp_streams,
           "environment": environment_info(), "kv_dtype": args.kv_dtype,
           "block_bytes": spec_for(DTYPES[args.kv_dtype]).block_nbytes, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["exact"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
