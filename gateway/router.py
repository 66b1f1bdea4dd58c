"""Worker pools and the router: least-loaded choice from periodic `GetLoad` polls.

Each pool (prefill or decode) owns one `grpc.aio` channel per worker. Its members are its
targets' current answer (gateway/discovery.py: fixed `host:port` entries and `dns:` names
re-resolved in the background): a new member enters routing once its gRPC health check says
SERVING and a poll answered; one that left is taken out of routing at once and its channel
closed when this gateway's last call on it ended. A background task polls `GetLoad` every
`poll_interval_s`; a worker leaves routing when its health check says it is not serving
(gateway/worker_health.py: several missed polls in a row, or a refusal, ask it; one late
poll does not) or a call on it failed UNAVAILABLE (`mark_failed`), until a later poll answers.

Routing key: (pending requests: this gateway's own in flight on the worker, plus the rest of the
last report's num_running + num_waiting; kv_cache_usage), lowest first; ties are broken
round-robin.
`pick_for_prefix` ranks workers by the longest prefix of the prompt's block hashes they are
believed to hold (`PrefixIndex`, recorded when a worker is picked and from prefill answers)
before load, within `max_imbalance` pending requests of the least loaded.
A call's retries on other workers (`Attempts`): after UNAVAILABLE (the worker is marked failed)
and after RESOURCE_EXHAUSTED (a full worker shedding load: skipped by that call alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import grpc

from engine_api.hashing import root_hash, salted_root
from gateway.discovery import PoolDiscovery
from gateway.errors import GatewayError, OverloadedError
from gateway.prefix_index import PrefixIndex, prompt_block_hashes
from gateway.worker_health import HealthPolicy, is_serving
from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2_grpc,
    prefill_pb2_grpc,
)
from rpc.auth import client_interceptors
from rpc.channels import ChannelCache
from rpc.limits import message_size_options
from rpc.tls import internal_channel

log = logging.getLogger(__name__)
T = TypeVar("T")


def worker_channel(address: str, internal_token: str | None) -> grpc.aio.Channel:
    """A channel to a worker whose calls carry the cluster's secret when there is one."""
    return internal_channel(address, options=message_size_options(),
                            interceptors=client_interceptors(internal_token))


@dataclass(slots=True)
class Worker:
    """One worker as the router sees it. Mutated only by its `WorkerPool` (on the loop)."""

    address: str
    channel: grpc.aio.Channel
    healthy: bool = False
    reported: bool = False      # answered at least one poll (`load` is a real report)
    admitted: bool = False      # its health check said SERVING since it (re)joined routing
    missed_polls: int = 0       # load polls in a row that failed
    load: common_pb2.LoadReport = field(default_factory=common_pb2.LoadReport)
    in_flight: int = 0          # this gateway's calls on it now: picked, not yet `done`
    in_flight_at_poll: int = 0  # the same when `load` arrived

    def routing_key(self) -> tuple[int, float]:
        """(pending requests, KV usage): this gateway's own calls in flight there, exact at
        any moment, plus the last report's running + waiting less ours then (others' load:
        other gateways', direct clients').

        Ours are counted here, not read from the report: a report taken during a burst kept the
        worker looking busy until the next poll (a second burst then went elsewhere wholesale:
        bench/results/cpu_prefix_routing/README.md), and correcting the report by the picks
        and ends since it undercounted a request that was on its way when it was taken."""
        others = self.load.num_running + self.load.num_waiting - self.in_flight_at_poll
        return max(0, others) + self.in_flight, self.load.kv_cache_usage

    def apply_report(self, report: common_pb2.LoadReport) -> None:
        """A `GetLoad` answer has arrived."""
        self.load = report
        self.in_flight_at_poll = self.in_flight
        self.healthy = True
        self.reported = True
        self.missed_polls = 0


class WorkerPool:
    """The workers of one role; `pick` chooses the least-loaded healthy one.

    targets: `host:port` entries and `dns:[//DNS_SERVER/]NAME:PORT` names (re-resolved every
    `discovery_interval_s`, sooner when their TTL is shorter)."""

    def __init__(self, role: Literal["prefill", "decode"], targets: Sequence[str], *,
                 poll_interval_s: float = 1.0, poll_timeout_s: float = 1.0,
                 internal_token: str | None = None, discovery_interval_s: float = 5.0,
                 health: HealthPolicy | None = None) -> None:
        self.role = role
        self.internal_token = internal_token  # sent with every call (rpc/auth.py)
        self._discovery = PoolDiscovery(targets, self.set_members,
                                        interval_s=discovery_interval_s, what=f"{role} pool")
        self.workers = [Worker(a, worker_channel(a, internal_token))
                        for a in self._discovery.initial_members()]
        # Workers that left the pool's targets, with calls of this gateway still on them: out of
        # routing, their channels closed once those calls ended (`_close_left`).
        self.leaving: list[Worker] = []
        self._poll_interval_s = poll_interval_s
        self._poll_timeout_s = poll_timeout_s
        self._health = health or HealthPolicy()
        self._rr = 0
        self.prefix_index = PrefixIndex()
        self.max_imbalance = 4  # pending requests a prefix hit may cost in load balance
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Resolve the targets and poll once (so members and health are known before serving),
        then keep doing both in the background."""
        await self._discovery.start()
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name=f"router-poll-{self.role}")

    async def close(self) -> None:
        await self._discovery.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(w.channel.close() for w in [*self.workers, *self.leaving]))

    def set_members(self, addresses: Sequence[str]) -> None:
        """The pool's workers are now `addresses`: new ones join (routed to once admitted:
        health SERVING, a poll answered), missing ones leave routing now and are closed when
        this gateway's calls on them ended (streams there finish; their leases are released
        through `Router.kv_transfer_stub`, which needs no pool member)."""
        current = {w.address: w for w in self.workers}
        wanted = set(addresses)
        for worker in self.workers:
            if worker.address not in wanted:
                log.info("%s worker %s left the pool (%d calls in flight)", self.role,
                         worker.address, worker.in_flight)
                worker.healthy = False
                self.leaving.append(worker)
                self.prefix_index.forget(worker.address)
        self.workers = [current.get(a) or Worker(a, worker_channel(a, self.internal_token))
                        for a in addresses]

    async def _close_left(self) -> None:
        """Close the channels of workers that left once no call of this gateway is on them."""
        done = [w for w in self.leaving if w.in_flight == 0]
        self.leaving = [w for w in self.leaving if w.in_flight > 0]
        await asyncio.gather(*(w.channel.close() for w in done))

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs after every poll round (e.g. to update the gRPC health status or
        the per-worker metrics)."""
        self._listeners.append(callback)

    # -- polling ---------------------------------------------------------------------------
    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll_worker(w) for w in self.workers))
        await self._close_left()
        for callback in self._listeners:
            callback()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def _poll_worker(self, worker: Worker) -> None:
        """One poll: admit a worker whose health check says SERVING, then ask its load; a
        failed poll is judged by `HealthPolicy` (gateway/worker_health.py)."""
        timeout_s = self._health.liveness_timeout_s
        if not worker.admitted:
            if not await is_serving(worker.channel, timeout_s):
                return
            worker.admitted = True
        stub = (prefill_pb2_grpc.PrefillStub if self.role == "prefill"
                else decode_pb2_grpc.DecodeStub)(worker.channel)
        try:
            report = await stub.GetLoad(common_pb2.LoadRequest(), timeout=self._poll_timeout_s)
        except grpc.aio.AioRpcError as err:
            worker.missed_polls += 1
            if self._health.tolerates(err.code(), worker.missed_polls):
                return  # late once or twice: keep routing on its last report
            if await is_serving(worker.channel, timeout_s):
                return  # alive (its polls are late or refused): it stays as it was
            if worker.healthy:
                log.warning("%s worker %s is out of routing: GetLoad %s (%d in a row), health "
                            "not SERVING", self.role, worker.address, err.code().name,
                            worker.missed_polls)
            worker.healthy = worker.admitted = False
            return
        worker.apply_report(report)

    # -- picking ---------------------------------------------------------------------------
    @property
    def num_healthy(self) -> int:
        return sum(w.healthy for w in self.workers)

    def pick(self, exclude: Sequence[str] = (), lora_name: str = "") -> Worker:
        """The least-loaded healthy worker not in `exclude` (serving LoRA adapter `lora_name`,
        when one is named); UNAVAILABLE when there is none. Counted as pending on it until
        `done(worker)`."""
        worker = self._least_loaded(self._candidates(exclude, lora_name))
        worker.in_flight += 1
        return worker

    def _candidates(self, exclude: Sequence[str], lora_name: str = "") -> list[Worker]:
        """The healthy workers not in `exclude` that serve `lora_name` (when named);
        UNAVAILABLE when there is none."""
        candidates = [w for w in self.workers if w.healthy and w.address not in exclude
                      and (not lora_name or lora_name in w.load.lora_adapters)]
        if not candidates:
            what = f" serving LoRA adapter {lora_name!r}" if lora_name else ""
            raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                               f"no healthy {self.role} worker{what} is available")
        return candidates

    def lora_adapters(self) -> set[str]:
        """The LoRA adapters the pool's healthy workers report serving."""
        return {name for w in self.workers if w.healthy for name in w.load.lora_adapters}

    def class_labels(self) -> tuple[str, ...] | None:
        """The classifier labels the pool's healthy workers report (() for an embedding model);
        None when no healthy worker has reported yet."""
        for w in self.workers:
            if w.healthy and w.reported:
                return tuple(w.load.class_labels)
        return None

    def _least_loaded(self, candidates: list[Worker]) -> Worker:
        best = min(w.routing_key() for w in candidates)
        tied = [w for w in candidates if w.routing_key() == best]
        worker = tied[self._rr % len(tied)]
        self._rr += 1
        return worker

    @staticmethod
    def done(worker: Worker) -> None:
        """The call a pick was for has ended (answered, failed or cancelled)."""
        worker.in_flight = max(0, worker.in_flight - 1)

    def prompt_hashes(self, prompt_token_ids: Sequence[int],
                      memo: dict[tuple[bytes, int], list[bytes]] | None = None,
                      lora_name: str = "", cache_salt: str = "") -> list[bytes]:
        """Block hashes of a prompt under the pool's KV layout (from the workers' load reports);
        for a LoRA adapter's request, chained from the adapter's root as its workers report it,
        and salted by the request's `cache_salt` as the workers salt it.
        `memo`: the prompt's hashes by layout (root) and block size, filled here (a request's
        prefill and decode pools and its completions then hash it once)."""
        memo = {} if memo is None else memo
        for w in self.workers:
            if not (w.healthy and w.load.block_size):
                continue
            root = adapter_root(w.load, lora_name) if lora_name else None
            if lora_name and root is None:
                continue  # this worker does not serve the adapter (or reports no root)
            if cache_salt and len(w.load.fingerprint) == 32:
                root = salted_root(root or root_hash(w.load.fingerprint), cache_salt)
            layout = (root or w.load.fingerprint, w.load.block_size)
            if layout not in memo:
                memo[layout] = prompt_block_hashes(prompt_token_ids, w.load.fingerprint,
                                                   w.load.block_size, root)
            return memo[layout]
        return []

    def pick_for_prefix(self, block_hashes: Sequence[bytes], exclude: Sequence[str] = (),
                        lora_name: str = "") -> Worker:
        """Longest cached prefix first, unless that worker is busier than the least-loaded one
        by more than `max_imbalance` pending requests; then least loaded.

        The chosen worker is recorded as holding the prompt's blocks at once, not when its
        prefill answers (as SGLang's router inserts at dispatch): requests sharing a prefix that
        arrive while the first of them is computed then follow it to that worker (until the
        imbalance rule spills them), instead of each computing the prefix somewhere else.
        A LoRA adapter's request (`lora_name`) goes to workers serving the adapter, its hashes
        chained from the adapter's root (`prompt_hashes`), never matching the base model's."""
        worker = self._pick_for_prefix(block_hashes, self._candidates(exclude, lora_name))
        worker.in_flight += 1
        if block_hashes:
            self.prefix_index.record(worker.address, block_hashes)
        return worker

    def _pick_for_prefix(self, block_hashes: Sequence[bytes], candidates: list[Worker]) -> Worker:
        if not block_hashes or len(candidates) < 2:
            return self._least_loaded(candidates)
        matched = {w.address: self.prefix_index.match(w.address, block_hashes)
                   for w in candidates}
        best = max(candidates, key=lambda w: matched[w.address])
        least = min(w.routing_key()[0] for w in candidates)
        if matched[best.address] == 0 or best.routing_key()[0] - least > self.max_imbalance:
            return self._least_loaded(candidates)
        return best

    def mark_failed(self, address: str) -> None:
        """Exclude a worker after a failed call; the next successful poll brings it back."""
        for w in self.workers:
            if w.address == address:
                w.healthy = False
        self.prefix_index.forget(address)  # it may come back restarted, its cache empty


@dataclass(slots=True)
class Attempts:
    """The workers of `pool` one call has tried, excluded from its next picks.

    A worker that answered UNAVAILABLE (down) is also marked failed in the pool until its next
    good poll; one that answered RESOURCE_EXHAUSTED (load shedding: healthy, only full) is
    skipped by this call alone: marking it failed would take a busy worker out of every other
    request's routing. Mutates the pool only through `mark_failed`."""

    pool: WorkerPool
    tried: list[str] = field(default_factory=list)
    num_failed: int = 0       # UNAVAILABLE answers so far
    num_refused: int = 0      # RESOURCE_EXHAUSTED answers so far

    def pick(self, block_hashes: Sequence[bytes], lora_name: str = "") -> Worker:
        """`pick_for_prefix` among the workers not tried yet. None left after a refusal: every
        worker this call could use is full or down, so the client is told to come back later
        (OverloadedError, 429) rather than that the service is down (the pool's UNAVAILABLE,
        raised as it is when no worker refused)."""
        try:
            return self.pool.pick_for_prefix(block_hashes, exclude=self.tried,
                                             lora_name=lora_name)
        except GatewayError:
            if not self.num_refused:
                raise
            raise OverloadedError(
                "workers_overloaded",
                f"overloaded: every {self.pool.role} worker is full ({self.num_refused} "
                f"refused the request); retry later") from None

    def retry(self, worker: Worker, err: grpc.aio.AioRpcError, max_failures: int) -> bool:
        """Whether to make the call again on another worker after `worker` answered `err`:
        yes when it was full (bounded by the pool's size: `pick` runs out of workers), or down
        while fewer than `max_failures` workers were down before."""
        code = err.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            log.debug("%s worker %s is full: %s", self.pool.role, worker.address, err.details())
            self.num_refused += 1
        elif code == grpc.StatusCode.UNAVAILABLE and self.num_failed < max_failures:
            self.pool.mark_failed(worker.address)
            self.num_failed += 1
        else:
            return False
        self.tried.append(worker.address)
        return True

    def abandon(self, worker: Worker, max_failures: int) -> bool:
        """Whether to make the call again on another worker after `worker` stopped answering
        mid-call (gateway/stream_watch.py): counted as down, as an UNAVAILABLE answer is."""
        if self.num_failed >= max_failures:
            return False
        self.pool.mark_failed(worker.address)
        self.num_failed += 1
        self.tried.append(worker.address)
        return True


async def call_routed(pool: WorkerPool, block_hashes: Sequence[bytes],
                      call: Callable[[Worker], Awaitable[T]], hop: str,
                      lora_name: str = "") -> T:
    """`call(worker)` on the pool's choice for a prompt of `block_hashes` (`pick_for_prefix`);
    a worker that answers UNAVAILABLE is excluded until its next good poll and the call made
    once more on another; one that answers RESOURCE_EXHAUSTED (full) is skipped and the call
    made on the next choice, until every worker was tried (then OverloadedError: 429).
    Any other failure is a `GatewayError` keeping the call's status, its message prefixed by
    `hop` ("prefill", "embed")."""
    attempts = Attempts(pool)
    while True:
        worker = attempts.pick(block_hashes, lora_name)
        try:
            return await call(worker)
        except grpc.aio.AioRpcError as err:
            if not attempts.retry(worker, err, max_failures=1):
                raise GatewayError.from_rpc(err, hop) from None
        finally:
            pool.done(worker)


def adapter_root(load: common_pb2.LoadReport, lora_name: str) -> bytes | None:
    """Adapter `lora_name`'s KV hash root as a worker reports it (None: not served, or a
    worker too old to report roots)."""
    names = list(load.lora_adapters)
    if lora_name not in names or len(load.lora_roots) != len(names):
        return None
    return bytes(load.lora_roots[names.index(lora_name)])


class Router:
    """The prefill and decode pools plus kept KvTransfer channels for lease releases (to the
    addresses handles name that are not a pool's: LRU-bounded, as a decode worker's are)."""

    def __init__(self, prefill: WorkerPool | None, decode: WorkerPool) -> None:
        self.prefill = prefill
        self.decode = decode
        self._kv_channels = ChannelCache(
            interceptors=client_interceptors(decode.internal_token), close_grace_s=5.0)

    async def start(self) -> None:
        pools = [p for p in (self.prefill, self.decode) if p is not None]
        await asyncio.gather(*(p.start() for p in pools))

    async def close(self) -> None:
        pools = [p for p in (self.prefill, self.decode) if p is not None]
        await asyncio.gather(*(p.close() for p in pools))
        await self._kv_channels.aclose()

    def prefill_stub(self, worker: Worker) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(worker.channel)

    def decode_stub(self, worker: Worker) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(worker.channel)

    @property
    def embed_pool(self) -> WorkerPool:
        """Where embeddings run: the prefill pool, which computes prompts (colocated: the
        only pool). Both services serve `Embed`."""
        return self.prefill or self.decode

    def embed_stub(self, worker: Worker) -> prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub:
        """A stub of `embed_pool`'s `worker` (its `Embed`)."""
        return self.prefill_stub(worker) if self.prefill is not None else self.decode_stub(worker)

    def kv_transfer_stub(self, address: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        """KvTransfer on `address` (a prefill worker's), reusing a pool channel when possible."""
        for pool in (self.prefill, self.decode):
            for w in pool.workers if pool is not None else ():
                if w.address == address:
                    return kv_transfer_pb2_grpc.KvTransferStub(w.channel)
        return kv_transfer_pb2_grpc.KvTransferStub(self._kv_channels.get(address))
