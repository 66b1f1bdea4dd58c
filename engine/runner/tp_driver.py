"""Rank 0's side of a tensor-parallel engine: starts the worker processes, then sends each
command (engine/parallel/protocol.py) and enters its collectives in the same order as they do.

Every collective of the group goes through `TensorParallelDriver.command`, which holds a lock
from the header's send to the end of rank 0's part: the engine's thread (forward passes) and
the KV handoff's threads (block reads and writes) may then share the group without
interleaving their collectives differently on different ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from engine.config import ConfigError, EngineConfig
from engine.parallel.group import (
    destroy_group,
    init_group,
    joined_key,
    one_device_check,
    rendezvous,
)
from engine.parallel.protocol import Op, WorkerSpec, pack
from engine.runner.tp_worker import worker_main

logger = logging.getLogger(__name__)

# How long the workers may take to load their shards before the engine gives up on them.
READY_TIMEOUT_S = 600.0


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or reported an error; the engine cannot step again."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the next GPUs after rank 0's, or the CPU (every rank on rank 0's
    GPU under `one_device_check`)."""
    if device.type != "cuda" or one_device_check():
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"tensor parallelism needs a GPU per rank: rank {rank} would use "
                          f"cuda:{index}, this host has {torch.cuda.device_count()}")
    return torch.device("cuda", index)


class TensorParallelDriver:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        """Start ranks 1..n-1 and join the group with them (returns once every rank joined;
        the workers then load their shards while this process loads its own)."""
        self.size = config.parallel.tensor_parallel_size
        self.device = device
        self._lock = threading.RLock()
        self.failed: str | None = None
        timeout_s = config.parallel.collective_timeout_s
        # Served before any worker connects; the group keeps using it (kept until shutdown).
        self._store: dist.TCPStore | None = rendezvous(0, self.size, 0, timeout_s)
        store = self._store
        ctx = mp.get_context("spawn")  # a forked CUDA context is unusable; spawn is the rule
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(1, self.size):
            dev = rank_device(device, rank)
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(config, rank, self.size, store.port, str(dev),
                              str(dtype).removeprefix("torch."), max_model_len)
            proc = ctx.Process(target=worker_main, args=(theirs, spec), daemon=True,
                               name=f"splitserve-tp-rank{rank}")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        try:
            self._join(store, device, timeout_s)
        except BaseException:
            self._stop_workers()
            raise
        logger.info("tensor parallelism: %d ranks (workers %s)", self.size,
                    [p.pid for p in self._procs])

    def _join(self, store: dist.TCPStore, device: torch.device, timeout_s: float) -> None:
        """Join the group once every worker has said it is joining, watching the workers
        meanwhile: one that exits first (a bad device, a failed import) fails the start at
        once with its message, instead of leaving this rank in the rendezvous for
        `timeout_s`."""
        keys = [joined_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True),
                                                start=1):
                if proc.is_alive():
                    continue
                why = f"exited with code {proc.exitcode}"
                with contextlib.suppress(EOFError, OSError):
                    if conn.poll():
                        why = conn.recv_bytes(1 << 16).decode("utf-8", "replace")
                raise ConfigError(f"tensor-parallel rank {rank} failed before joining the "
                                  f"group: {why}")
            if time.monotonic() > deadline:
                raise ConfigError(f"tensor-parallel workers did not join within {timeout_s:.0f} s")
            time.sleep(0.05)
        init_group(self, 0, self.size, store, device, timeout_s)

    # ---- lifecycle -------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every worker has loaded its shard; ConfigError with the worker's own
        message when one failed (a bad checkpoint, a model that does not split)."""
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.shutdown()
                raise ConfigError(f"tensor-parallel rank {rank} did not load its shard within "
                                  f"{timeout_s:.0f} s")
            try:
                reply = conn.recv_bytes(1 << 16).decode("utf-8", "replace")
            except (EOFError, OSError):
                reply = "exited while loading its shard"
            if reply != "ok":
                self.shutdown()
                raise ConfigError(f"tensor-parallel rank {rank} failed: {reply}")

    def shutdown(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(pack(Op.SHUTDOWN))
            self._stop_workers()
            destroy_group(self)
            self._store = None

    def _stop_workers(self) -> None:
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def check_alive(self) -> None:
        """WorkerFailed when a worker has exited (before a command would wait for it)."""
        if self.failed is None:
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():
                    self.failed = f"tensor-parallel rank {rank} exited (code {proc.exitcode})"
        if self.failed is not None:
            raise WorkerFailed(self.failed)

    # ---- commands --------------------------------------------------------------------------

    @contextlib.contextmanager
    def command(self, op: Op, fields: list[int] | tuple[int, ...] = ()) -> Iterator[None]:
        """Send `op` to every worker, then run the body (rank 0's part, with the same
        collectives in the same order) under the group's lock. A failure inside leaves the
        group out of step: the driver is marked failed and refuses further commands."""
        with self._lock:
            self.check_alive()
            header = pack(op, fields)
            try:
                for conn in self._conns:
                    conn.send_bytes(header)
                yield
            except BaseException as e:
                self.failed = f"tensor-parallel command {op.name} failed: {e!r}"
                raise

    def capacity(self, local_blocks: int) -> int:
        """The smallest KV block capacity over the ranks (this one's is `local_blocks`)."""
        with self.command(Op.KV_CAPACITY):
            t = torch.tensor([local_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            return int(t.item())

    def allocate_kv(self, num_blocks: int) -> None:
        with self.command(Op.ALLOCATE_KV, [num_blocks]):
            pass

    def add_lora(self, name: str, path: str, local: Callable[[], object],
                 undo: Callable[[], object]) -> bool:
        """Load adapter `name` from `path` on every rank: the workers read their shares while
        `local()` adds rank 0's; then every rank's success is all-reduced. When one failed,
        the others undo theirs (`undo()` here) and this returns False; rank 0's own failure
        is re-raised (after the others undid theirs)."""
        payload = json.dumps({"name": name, "path": path}).encode()
        error: Exception | None = None
        with self.command(Op.LORA_ADD, [len(payload)]):
            for conn in self._conns:
                conn.send_bytes(payload)
            try:
                local()
            except Exception as e:  # every rank must still reach the all-reduce
                error = e
            ok = torch.tensor([int(error is None)], dtype=torch.int64, device=self.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            everyone = bool(ok.item())
            if not everyone and error is None:
                undo()
        if error is not None:
            raise error
        return everyone

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name` on every worker (rank 0 removes its own)."""
        payload = json.dumps({"name": name}).encode()
        with self.command(Op.LORA_REMOVE, [len(payload)]):
            for conn in self._conns:
                conn.send_bytes(payload)

    def set_kv_scales(self, scales: torch.Tensor, factors: torch.Tensor | None = None) -> None:
        """Every rank's quantized cache takes rank 0's `[L, 2]` scales and `[L, 2, Hkv, D]`
        channel factors of every KV head, each rank applying its own heads' (calibrated over
        every rank's heads: `measure_kv_amax` gathers the maxima)."""
        shape = [0, 0] if factors is None else [int(factors.shape[2]), int(factors.shape[3])]
        with self.command(Op.SET_KV_SCALES, [int(scales.shape[0]), *shape]):
            dist.broadcast(scales.to(self.device, torch.float32).contiguous(), src=0)
            if factors is not None:
                dist.broadcast(factors.to(self.device, torch.float32).contiguous(), src=0)
