"""Runtime LoRA adapters: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(and the gRPC Gateway's `LoadLoRAAdapter` / `UnloadLoRAAdapter`), one change fanned out to
every healthy worker of every pool, all or nothing.

A load goes to every healthy worker at once; if any refuses, the adapter is unloaded again from
those that took it and the first refusal (in pool order: prefill, then decode) is the answer.
An unload likewise: when a worker refuses (requests still use the adapter there), those that
unloaded it load it back from the directory they report, so it stays served everywhere; a
worker that does not have it (restarted since, say) is no refusal, as long as one did. Then the
pools' load reports are polled at once, so that `/v1/models` and routing see the change by the
time the call answers. Workers down at the time are skipped: one that comes back (or restarts)
gets the runtime adapters the other workers report back from any gateway with the flag
(`watch_workers`).

Only on a gateway started with --allow-runtime-lora-updating (else PERMISSION_DENIED: 403);
one change at a time (`GatewayState.lora_lock`), shielded from the caller's cancellation so
that a client gone mid-way never leaves an adapter on some workers only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.router import Router, Worker, WorkerPool
from gateway.state import GatewayState
from protos.splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from rpc.limits import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS, lora_field_problem

log = logging.getLogger(__name__)
T = TypeVar("T")

LORA_UPDATING_OFF = ("runtime LoRA adapter loading is off on this gateway: start it with "
                     "--allow-runtime-lora-updating (and the workers with --max-loras N)")


@dataclass(frozen=True, slots=True)
class LoRAChange:
    """What a load or an unload left."""

    lora_adapters: list[str]  # the adapters requests may name on this gateway now
    lora_path: str = ""       # an unload: the directory a worker had the adapter from


@dataclass(frozen=True, slots=True)
class _Target:
    """One healthy worker a change goes to."""

    pool: WorkerPool
    worker: Worker

    def _stub(self) -> prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub:
        # A colocated worker serves Decode (its pool is the decode one).
        stub = (prefill_pb2_grpc.PrefillStub if self.pool.role == "prefill"
                else decode_pb2_grpc.DecodeStub)
        return stub(self.worker.channel)

    async def load(self, name: str, path: str, timeout_s: float
                   ) -> common_pb2.LoadLoRAAdapterResponse:
        request = common_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        response: common_pb2.LoadLoRAAdapterResponse = await self._stub().LoadLoRAAdapter(
            request, timeout=timeout_s)
        return response

    async def unload(self, name: str, timeout_s: float) -> common_pb2.UnloadLoRAAdapterResponse:
        request = common_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        response: common_pb2.UnloadLoRAAdapterResponse = await self._stub().UnloadLoRAAdapter(
            request, timeout=timeout_s)
        return response

    def error(self, err: BaseException) -> GatewayError:
        """A worker's refusal as the client sees it (its status kept); anything but an RPC
        error is re-raised."""
        if not isinstance(err, grpc.aio.AioRpcError):
            raise err
        return GatewayError.from_rpc(err, self.pool.role)


# -- checks -------------------------------------------------------------------------------------
def check_allowed(config: GatewayConfig) -> None:
    """PERMISSION_DENIED unless the gateway runs with --allow-runtime-lora-updating."""
    if not config.allow_runtime_lora_updating:
        raise GatewayError(grpc.StatusCode.PERMISSION_DENIED, LORA_UPDATING_OFF)


def _check_name(name: str, config: GatewayConfig) -> None:
    problem = lora_field_problem("lora_name", name, MAX_LORA_NAME_CHARS)
    if problem is not None:
        raise GatewayError.invalid("lora_name", problem)
    if name == config.served_model_name:  # requests naming it would get the base model
        raise GatewayError.invalid("lora_name", f"lora_name {name!r} is the base model's name; "
                                                "give the adapter another")


def _check_path(path: str) -> None:
    problem = lora_field_problem("lora_path", path, MAX_LORA_PATH_CHARS)
    if problem is not None:
        raise GatewayError.invalid("lora_path", problem)


# -- the changes --------------------------------------------------------------------------------
async def load_adapter(state: GatewayState, name: str, path: str) -> LoRAChange:
    """Load adapter `name` from directory `path` (as the workers see it) on every healthy
    worker, or on none (GatewayError: the first worker's refusal)."""
    check_allowed(state.config)
    change = await load_everywhere(state, name, path)
    _disown(state, name)
    return change


async def unload_adapter(state: GatewayState, name: str) -> LoRAChange:
    """Unload adapter `name` from every healthy worker that has it, or from none (GatewayError:
    a worker's refusal; NOT_FOUND when no worker has it)."""
    check_allowed(state.config)
    change = await unload_everywhere(state, name)
    _disown(state, name)
    return change


def _disown(state: GatewayState, name: str) -> None:
    """An adapter an operator loaded or unloaded is not the resolver's to unload any more."""
    if state.lora_resolver is not None:
        state.lora_resolver.loaded.discard(name)


async def load_everywhere(state: GatewayState, name: str, path: str) -> LoRAChange:
    """`load_adapter` without the flag's check: also the resolver's
    (gateway/model_resolution.py)."""
    _check_name(name, state.config)
    _check_path(path)
    await asyncio.shield(_locked(state, _load(state, name, path)))
    return LoRAChange(sorted(state.lora_adapters()))


async def unload_everywhere(state: GatewayState, name: str) -> LoRAChange:
    """`unload_adapter` without the flag's check: also the resolver's."""
    _check_name(name, state.config)
    path = await asyncio.shield(_locked(state, _unload(state, name)))
    return LoRAChange(sorted(state.lora_adapters()), path)


async def _locked(state: GatewayState, change: Awaitable[T]) -> T:
    """`change` alone, then the pools polled at once (whatever its outcome: an undone change
    may have been seen half done by a background poll)."""
    async with state.lora_lock:
        try:
            return await change
        finally:
            await poll_pools(state.router)


async def _load(state: GatewayState, name: str, path: str) -> None:
    targets = _targets(state.router)
    timeout_s = state.config.request_timeout_s
    results = await asyncio.gather(*(t.load(name, path, timeout_s) for t in targets),
                                   return_exceptions=True)
    failed = [(t, r) for t, r in zip(targets, results, strict=True)
              if isinstance(r, BaseException)]
    if failed:
        took = [t for t, r in zip(targets, results, strict=True)
                if not isinstance(r, BaseException)]
        await asyncio.gather(*(_undo(t, "unload", t.unload(name, timeout_s)) for t in took))
        target, err = failed[0]
        raise target.error(err)
    state.runtime_loras[name] = path
    log.info("LoRA adapter %r loaded from %s on %d workers", name, path, len(targets))


async def _unload(state: GatewayState, name: str) -> str:
    """The directory the (first) worker had the adapter from."""
    targets = _targets(state.router)
    timeout_s = state.config.request_timeout_s
    results = await asyncio.gather(*(t.unload(name, timeout_s) for t in targets),
                                   return_exceptions=True)
    removed: list[tuple[_Target, common_pb2.UnloadLoRAAdapterResponse]] = []
    refused: list[tuple[_Target, BaseException]] = []
    for target, result in zip(targets, results, strict=True):
        if isinstance(result, common_pb2.UnloadLoRAAdapterResponse):
            removed.append((target, result))
        elif not _not_found(result):
            refused.append((target, result))
    if refused:
        await asyncio.gather(*(_undo(t, "reload", t.load(name, r.lora_path, timeout_s))
                               for t, r in removed))
        target, err = refused[0]
        raise target.error(err)
    if not removed:
        raise GatewayError(grpc.StatusCode.NOT_FOUND,
                           f"LoRA adapter {name!r} is not loaded on any worker (loaded: "
                           f"{', '.join(map(repr, sorted(state.lora_adapters()))) or 'none'})",
                           param="lora_name", error_code="model_not_found")
    state.runtime_loras.pop(name, None)
    log.info("LoRA adapter %r unloaded from %d workers", name, len(removed))
    return removed[0][1].lora_path


def _targets(router: Router) -> list[_Target]:
    """Every healthy worker of every pool; UNAVAILABLE when a pool has none (the adapter
    could not serve a request there)."""
    targets: list[_Target] = []
    for pool in (router.prefill, router.decode):
        if pool is None:
            continue
        healthy = [w for w in pool.workers if w.healthy]
        if not healthy:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                               f"no healthy {pool.role} worker is available")
        targets.extend(_Target(pool, w) for w in healthy)
    return targets


def _not_found(result: BaseException | common_pb2.UnloadLoRAAdapterResponse) -> bool:
    return (isinstance(result, grpc.aio.AioRpcError)
            and result.code() == grpc.StatusCode.NOT_FOUND)


async def _undo(target: _Target, what: str, call: Awaitable[object]) -> None:
    """Undo one worker's part of a change that failed elsewhere; a failure is logged (that
    worker is then left out of step with the others: its load report shows it)."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        log.error("%s worker %s: could not %s the LoRA adapter to undo a failed change: %s",
                  target.pool.role, target.worker.address, what, err.details())


def watch_workers(state: GatewayState) -> None:
    """After every poll round: when a healthy worker lacks an adapter loaded at runtime (by
    this gateway, or by another one: the workers report runtime adapters' directories) while
    other workers still serve it, and has a free slot, load it there (`reconcile`, in the
    background; one at a time). A restarted worker comes back with its start-time adapters
    only. Only on a gateway that takes adapter updates (--allow-runtime-lora-updating): the
    others leave the workers' adapters alone."""
    if not state.config.allow_runtime_lora_updating:
        return

    def check() -> None:
        task = state.reconcile_task
        if (task is None or task.done()) and _missing(state):
            state.reconcile_task = asyncio.create_task(reconcile(state), name="lora-reconcile")

    for pool in (state.router.prefill, state.router.decode):
        if pool is not None:
            pool.add_listener(check)


async def reconcile(state: GatewayState) -> None:
    """Load the adapters `_missing` names onto their workers, under the change lock (so never
    against a load or unload of this gateway's in progress); failures are logged and tried
    again after a later poll."""
    async with state.lora_lock:
        todo = _missing(state)
        if not todo:
            return
        timeout_s = state.config.request_timeout_s
        results = await asyncio.gather(*(t.load(name, path, timeout_s) for t, name, path in todo),
                                       return_exceptions=True)
        for (target, name, _), result in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s worker %s lacks LoRA adapter %r and could not load it: %s",
                            target.pool.role, target.worker.address, name, result)
            else:
                log.info("%s worker %s lacked LoRA adapter %r (restarted?): loaded it again",
                         target.pool.role, target.worker.address, name)
        await poll_pools(state.router)


def _missing(state: GatewayState) -> list[tuple[_Target, str, str]]:
    """(worker, adapter, directory) for each runtime adapter that a healthy worker with a slot
    to spare has lacked for two poll intervals while another healthy worker serves it. The
    runtime adapters: those this gateway loaded, and those any worker reports with a runtime
    directory (another gateway's loads). Not when no worker serves it any more: another
    gateway unloaded it (this one forgets it then), and two intervals let such an unload,
    which reaches every worker within one, finish before anything is put back."""
    workers = [(pool, w) for pool in (state.router.prefill, state.router.decode)
               if pool is not None for w in pool.workers if w.healthy and w.reported]
    served = {n for _, w in workers for n in w.load.lora_adapters}
    for name in [n for n in state.runtime_loras if n not in served]:
        del state.runtime_loras[name]
    runtime = dict(state.runtime_loras)
    for _, w in workers:
        for name, path in zip(w.load.lora_adapters, w.load.lora_paths, strict=False):
            if path:
                runtime.setdefault(name, path)
    if not runtime:
        state.lora_gaps = {}
        return []
    now = time.monotonic()
    settle_s = 2 * state.config.load_poll_interval_s
    gaps: dict[tuple[str, str], float] = {}
    out: list[tuple[_Target, str, str]] = []
    for pool, w in workers:
        if not w.load.max_loras:
            continue
        free = w.load.max_loras - len(w.load.lora_adapters)
        for name, path in runtime.items():
            if name in w.load.lora_adapters:
                continue
            key = (w.address, name)
            since = gaps[key] = state.lora_gaps.get(key, now)
            if now - since >= settle_s and free > 0:
                out.append((_Target(pool, w), name, path))
                free -= 1
    state.lora_gaps = gaps
    return out


async def poll_pools(router: Router) -> None:
    """Poll every pool now: the workers' adapters into their load reports."""
    pools: Sequence[WorkerPool] = [p for p in (router.prefill, router.decode) if p is not None]
    await asyncio.gather(*(p.poll_once() for p in pools))
