"""Degraded, never down: which pool serves a request, from the pools' health.

Roles are policies of one engine, so any live worker can serve a whole request:

- `disaggregated`: prefill on the prefill pool, decode on the decode pool (both healthy);
- `decode_only`: no healthy prefill worker; requests go whole to decode workers, which compute
  the prompt themselves (as a colocated worker does, or as a resumed stream always did);
- `prefill_only`: no healthy decode worker; requests go whole to prefill workers' `Decode`
  service (worker/decode_servicer.py), which runs them to their end on the prefill engine;
- `colocated`: configured so (no prefill pool); `unavailable`: no healthy worker at all.

The mode is derived on demand from the workers' health (a poll round, or a call that found a
worker down, `WorkerPool.mark_failed`), so a request never waits for the next poll to go
elsewhere. Each change is logged once and shown by the `splitserve:serving_mode{mode}` gauge
(1 for the current mode) and counted by `splitserve:serving_mode_changes{mode}`; `/health`
names it. A degraded worker keeps its own admission limits: a full one refuses
(RESOURCE_EXHAUSTED) and the gateway answers 429 with Retry-After, as in any mode.
"""

from __future__ import annotations

import enum
import functools
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.router import Attempts, Router, WorkerPool

log = logging.getLogger(__name__)


class ServingMode(enum.StrEnum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"
    DECODE_ONLY = "decode_only"
    PREFILL_ONLY = "prefill_only"
    UNAVAILABLE = "unavailable"


def mode_of(prefill: WorkerPool | None, decode: WorkerPool) -> ServingMode:
    """The mode the pools' health allows now (`prefill` None: a colocated deployment)."""
    decode_up = decode.num_healthy > 0
    if prefill is None:
        return ServingMode.COLOCATED if decode_up else ServingMode.UNAVAILABLE
    prefill_up = prefill.num_healthy > 0
    if prefill_up and decode_up:
        return ServingMode.DISAGGREGATED
    if decode_up:
        return ServingMode.DECODE_ONLY
    if prefill_up:
        return ServingMode.PREFILL_ONLY
    return ServingMode.UNAVAILABLE


class ServingModes:
    """The router's current mode, with a log line and metrics on every change.

    `refresh` runs after every poll round of either pool; the orchestrator asks `current()`
    for each completion (and again when a worker fails mid-call)."""

    def __init__(self, router: Router, registry: CollectorRegistry) -> None:
        self._router = router
        self._gauge = Gauge("splitserve:serving_mode",
                            "1 for the gateway's serving mode now: disaggregated, colocated, "
                            "decode_only (no healthy prefill worker), prefill_only (no healthy "
                            "decode worker) or unavailable.", ["mode"], registry=registry)
        self._changes = Counter("splitserve:serving_mode_changes",
                                "Changes of the gateway's serving mode, by the mode entered.",
                                ["mode"], registry=registry)
        for mode in ServingMode:
            self._gauge.labels(mode=mode.value).set(0.0)
        # None until every pool finished its first poll round (the router polls them at once
        # on start: the first one done is no mode of the deployment's); then the last seen.
        self._mode: ServingMode | None = None
        pools = [p for p in (router.prefill, router.decode) if p is not None]
        self._unpolled = {p.role for p in pools}
        for pool in pools:
            pool.add_listener(functools.partial(self._after_poll, pool.role))

    @property
    def mode(self) -> ServingMode:
        """The mode as of the last `current()` or poll round."""
        return self._mode or mode_of(self._router.prefill, self._router.decode)

    def _after_poll(self, role: str) -> None:
        self._unpolled.discard(role)
        if not self._unpolled:
            self.current()

    def current(self) -> ServingMode:
        """The mode now; logs and counts a change (the first one found, too)."""
        mode = mode_of(self._router.prefill, self._router.decode)
        if mode != self._mode and not self._unpolled:
            before, self._mode = self._mode, mode
            if before is not None:
                self._gauge.labels(mode=before.value).set(0.0)
                self._changes.labels(mode=mode.value).inc()
            self._gauge.labels(mode=mode.value).set(1.0)
            level = logging.INFO if mode in _SERVING_FULLY else logging.WARNING
            change = mode.value if before is None else f"{before.value} -> {mode.value}"
            log.log(level, "serving mode %s (healthy workers: %s)", change, self._describe())
        return mode

    def prefills(self) -> bool:
        """Whether a request starts with a Prefill call (disaggregated serving now)."""
        return self.current() == ServingMode.DISAGGREGATED

    def decode_pool(self) -> WorkerPool:
        """Where Decode calls go now: the decode pool, or the prefill pool while no decode
        worker is healthy (its workers serve Decode too). With neither healthy, the decode
        pool (whose pick raises the usual UNAVAILABLE)."""
        prefill = self._router.prefill
        if self.current() == ServingMode.PREFILL_ONLY and prefill is not None:
            return prefill
        return self._router.decode

    def fallback_pool(self, pool: WorkerPool, attempts: Attempts) -> WorkerPool | None:
        """The pool a Decode call goes on in once `pool` has no worker left to try: the other
        one when it has a healthy worker and no worker refused the call for load (that is a
        429 to the client, not a reason to move to the other role's workers); else None."""
        if attempts.num_refused:
            return None
        prefill, decode = self._router.prefill, self._router.decode
        other = decode if pool is prefill else prefill
        if other is None or other.num_healthy == 0:
            return None
        self.current()  # a worker failed since the last look: log the change now
        return other

    def _describe(self) -> str:
        pools = [p for p in (self._router.prefill, self._router.decode) if p is not None]
        return ", ".join(f"{p.role} {p.num_healthy}/{len(p.workers)}" for p in pools)


_SERVING_FULLY = (ServingMode.DISAGGREGATED, ServingMode.COLOCATED)
