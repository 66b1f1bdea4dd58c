"""A request's `model` to the name the workers serve it under, and LoRA adapters loaded when a
request first names them (vLLM's filesystem LoRA resolver, `--lora-resolver-dir DIR`): a `model`
that is neither the base model nor an adapter the workers serve, but the name of a directory
DIR/<model>, is loaded on every worker (gateway/lora_admin.py's all-or-nothing fan-out) before
the request runs.

The workers' slots are few (`--max-loras`): when one of them has no free slot, the adapters this
resolver loaded (this gateway's resolver: each gateway knows its own) are unloaded least
recently used first — a worker refuses one that requests
still run, and the next is tried; if every one is in use the request is refused with 429
(retry later). Adapters the workers were started with, or that `/v1/load_lora_adapter` loaded,
are never unloaded here. Requests for a name with no directory are 404s, as before.
"""

from __future__ import annotations

import grpc

from gateway.errors import GatewayError, OverloadedError
from gateway.lora_admin import load_everywhere, poll_pools, unload_everywhere
from gateway.lora_resolver import LoRAResolver
from gateway.router import Router
from gateway.state import GatewayState


async def resolve_model(state: GatewayState, model: str | None, *, load: bool = True) -> str:
    """A request's `model` as the workers name it: "" for the base model (or none given), else
    the adapter's name — loaded first when the resolver has its directory and `load` (without
    `load`, a resolvable name is accepted as it is: tokenizing needs no adapter). NOT_FOUND
    for anything else, as vLLM answers."""
    lora = state.lora_name_for(model)
    resolver = state.lora_resolver
    if lora is None and model and resolver is not None:
        if not load and resolver.directory(model) is not None:
            return model
        if await _resolve(state, resolver, model):
            lora = model
    if lora is None:
        raise GatewayError(grpc.StatusCode.NOT_FOUND,
                           f"The model `{model}` does not exist; this server serves "
                           + ", ".join(f"`{m}`" for m in state.served_models()),
                           param="model", error_code="model_not_found")
    if lora and resolver is not None:
        resolver.touch(lora)
    return lora


async def _resolve(state: GatewayState, resolver: LoRAResolver, name: str) -> bool:
    """Whether adapter `name` is served after this call (loaded now if need be). Raises the
    load's GatewayError, or OverloadedError when no slot can be freed."""
    path = resolver.directory(name)
    if path is None:
        return False
    async with resolver.lock:
        if name in state.lora_adapters():  # loaded while this request waited
            return True
        await poll_pools(state.router)  # the slots as they are now, not at the last poll
        if name in state.lora_adapters():
            return True
        await _make_room(state, resolver, name)
        await load_everywhere(state, name, path)
        resolver.loaded.add(name)
        resolver.touch(name)
        return True


async def _make_room(state: GatewayState, resolver: LoRAResolver, name: str) -> None:
    """Unload the resolver's least recently used adapters until every worker has a slot."""
    refused: set[str] = set()
    while _slots_full(state.router):
        victims = resolver.victims(state.lora_adapters(),
                                   {name} | refused | _busy(state.router))
        if not victims:
            raise OverloadedError(
                "workers_overloaded",
                f"every LoRA adapter slot is taken by an adapter in use or loaded at start; "
                f"{name!r} can be loaded once one is free: retry later")
        victim = victims[0]
        try:
            await unload_everywhere(state, victim)
        except GatewayError as err:
            if err.code != grpc.StatusCode.FAILED_PRECONDITION:  # not "in use": a fault
                raise
            refused.add(victim)
            continue
        resolver.loaded.discard(victim)


def _busy(router: Router) -> set[str]:
    """Adapters with unfinished requests on some healthy worker, at the last poll (a worker
    still refuses to unload one that became busy since)."""
    busy: set[str] = set()
    for pool in (router.prefill, router.decode):
        if pool is None:
            continue
        for w in pool.workers:
            r = w.load
            if w.healthy:
                busy.update(n for n, running, waiting in zip(
                    r.lora_adapters, r.lora_running, r.lora_waiting, strict=False)
                    if running or waiting)
    return busy


def _slots_full(router: Router) -> bool:
    """Whether a healthy worker that takes adapters at runtime has every slot taken."""
    for pool in (router.prefill, router.decode):
        if pool is None:
            continue
        for w in pool.workers:
            if w.healthy and w.load.max_loras and len(w.load.lora_adapters) >= w.load.max_loras:
                return True
    return False
