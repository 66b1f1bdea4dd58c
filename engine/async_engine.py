"""AsyncEngine: runs an LLMEngine in its own thread and exposes it to an asyncio loop.

The event loop never blocks on the engine: requests and control calls go through a command
queue that the engine thread drains between steps; outputs come back through per-request
asyncio queues (`loop.call_soon_threadsafe`). KV loads that the scheduler starts (decode role)
are handed to an async `kv_loader` on the loop; its result is fed back as a command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.handoff import KvLoad
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

KvLoader = Callable[[KvLoad], Awaitable[bool]]


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class EngineOverloadedError(RuntimeError):
    """The engine holds as many requests as `SchedulerConfig.max_queued_requests` allows:
    this one is refused before anything is queued (load shedding; retry later or elsewhere)."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_leases: int
    spec_draft_tokens: int = 0      # speculative decoding: drafts verified
    spec_accepted_tokens: int = 0   # ... and accepted


class KvLoadAbort(Exception):
    """Raised by a kv_loader when the request must fail instead of recomputing its prompt."""


class _Failure:
    """Delivered into a request's queue when the engine fails it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class AsyncEngine:
    def __init__(self, engine: LLMEngine, kv_loader: KvLoader | None = None,
                 idle_integrity_check: bool = True) -> None:
        self.engine = engine
        self.kv_loader = kv_loader
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...],
                                                asyncio.Future[Any] | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue[StepOutput | _Failure]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._idle_check = idle_integrity_check
        self.dead: BaseException | None = None
        self._load_tasks: set[asyncio.Future[None]] = set()
        # Structured outputs' constraints compile here (milliseconds to seconds each): a few
        # threads of their own, so a burst of new schemas cannot take the loop's default
        # executor from the KV block reads that share it.
        self._compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self._compiles.shutdown(wait=False, cancel_futures=True)

    # ---- public API (event loop side) ------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       options: RequestOptions) -> AsyncIterator[StepOutput]:
        """Stream a request's step outputs. Validation errors raise before anything is queued.
        Cancelling the consumer (or closing the generator) aborts the request and frees its KV.
        `PoolingParams` in `options`: an embedding request, whose one output carries its
        embedding."""
        self._check_alive()
        self.engine.check_request(prompt_token_ids, options)
        params = options.params
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self.engine.config.scheduler.policy != "priority":
            self._check_capacity()  # refused before a grammar is compiled for it
        grammar = None
        # Compiling a constraint may take a while: not on the loop.
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            grammar = await asyncio.get_running_loop().run_in_executor(
                self._compiles, self.engine.make_grammar, params, options.output_token_ids)
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in flight")
        await self._admit(options.priority)  # (others may have come in while it compiled)
        q: asyncio.Queue[StepOutput | _Failure] = asyncio.Queue()
        self._queues[request_id] = q
        self._submit(self.engine.enqueue, (request_id, prompt_token_ids, options),
                     kwargs={"grammar": grammar})
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, _Failure):
                    finished = True
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._submit(self.engine.abort_request, (request_id,))

    @property
    def capacity(self) -> int | None:
        """Requests this engine holds at most before refusing more (None: no bound): its
        running seats plus `max_queued_requests`."""
        sched = self.engine.config.scheduler
        if sched.max_queued_requests is None:
            return None
        return sched.max_num_seqs + sched.max_queued_requests

    @property
    def num_in_flight(self) -> int:
        """Requests accepted by `generate` and not finished (loop side: no race)."""
        return len(self._queues)

    async def _admit(self, priority: int) -> None:
        """Room for one more request, or EngineOverloadedError. Under the priority policy a
        full engine first displaces its least urgent waiting request of a strictly less urgent
        priority that was never scheduled (nothing of it streamed yet: its client sees the
        same refusal a new request would, and may retry elsewhere), as SGLang's priority
        scheduling does with a full queue."""
        cap = self.capacity
        if cap is None or len(self._queues) < cap:
            return
        if self.engine.config.scheduler.policy == "priority":
            victim = await self.call(self._displace_for, priority)
            q = self._queues.get(victim) if victim is not None else None
            if q is not None:
                q.put_nowait(_Failure(EngineOverloadedError(
                    f"overloaded: displaced by a more urgent request (priority {priority}) "
                    "before it was scheduled; retry later")))
                return
        self._check_capacity()

    def _displace_for(self, priority: int) -> str | None:
        """Engine thread: abort the least urgent never-scheduled waiting request of a priority
        value above `priority`; its id, or None when there is none."""
        for req in reversed(list(self.engine.scheduler.waiting)):  # least urgent first
            if req.priority <= priority:
                return None  # the rest are at least as urgent
            if req.metrics.first_scheduled_time is None and req.request_id in self._queues:
                self.engine.abort_request(req.request_id)
                return req.request_id
        return None

    def _check_capacity(self) -> None:
        cap = self.capacity
        if cap is not None and len(self._queues) >= cap:
            raise EngineOverloadedError(
                f"overloaded: {len(self._queues)} requests in flight, at most {cap} "
                f"(max_num_seqs {self.engine.config.scheduler.max_num_seqs} + "
                f"max_queued_requests {self.engine.config.scheduler.max_queued_requests}); "
                "retry later")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread between steps and return its result."""
        self._check_alive()
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._commands.put((fn, args, fut))
        self._wake.set()
        return await fut

    async def calibrate_speculation(self) -> int:
        """Measure the speculation step cost while the engine is idle, one point at a time
        between requests (engine/spec/calibrate.py); returns the steps run."""
        from engine.spec.calibrate import calibrate_when_idle

        return await calibrate_when_idle(self, self.engine)

    async def abort(self, request_id: str) -> None:
        self._submit(self.engine.abort_request, (request_id,))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the engine thread between steps; fire and forget."""
        self._submit(fn, args)

    def stats(self) -> EngineStats:
        """A racy but consistent-enough snapshot for load reports and metrics."""
        s, kv = self.engine.scheduler, self.engine.kv
        return EngineStats(s.num_running, s.num_waiting, kv.usage(), kv.num_free_blocks,
                           kv.num_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits,
                           s.num_preemptions, len(s.leases), s.num_draft_tokens,
                           s.num_accepted_tokens)

    # ---- engine thread ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead is not None or self._stopped.is_set():
            raise EngineDeadError(f"engine is not running: {self.dead!r}")

    def _submit(self, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any] | None = None) -> None:
        call = (lambda: fn(*args, **kwargs)) if kwargs else (lambda: fn(*args))
        self._commands.put((call, (), None))
        self._wake.set()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args)
            except Exception as e:  # a bad command fails only its caller
                if fut is not None:
                    self._resolve(fut, error=e)
                else:
                    logger.warning("engine command failed: %r", e)
                    self._fail_unknown(e)
                continue
            if fut is not None:
                self._resolve(fut, result=result)

    def _run(self) -> None:
        eng = self.engine
        if eng.runner.step_stream is not None:  # this thread's own current stream is the default
            torch.cuda.set_stream(eng.runner.step_stream)
        checked = False  # integrity is checked once per idle period (it is O(num_blocks))
        try:
            while not self._stopped.is_set():
                self._drain_commands()
                if not eng.has_unfinished_requests():
                    if self._idle_check and not checked:
                        eng.scheduler.check_integrity()
                        checked = True
                    self._wake.wait(timeout=0.05 if eng.scheduler.leases else 1.0)
                    self._wake.clear()
                    eng.scheduler.expire_leases()
                    continue
                checked = False
                try:
                    outputs = eng.step()
                except Exception as e:
                    logger.exception("engine step failed; failing the running requests")
                    self._fail_running(e)
                    continue
                loads = eng.take_kv_loads()
                if loads:
                    self._post(self._start_loads, loads)
                if outputs:
                    self._post(self._dispatch, outputs)
                if eng.scheduler.only_loads_pending() and not eng.has_step_in_flight:
                    # Only KV loads in flight: wait for a command instead of spinning.
                    self._wake.wait(timeout=0.01)
                    self._wake.clear()
        except BaseException as e:  # pragma: no cover - fatal
            self.dead = e
            logger.exception("engine thread died")
            self._post(self._fail_all, e)

    def _fail_running(self, error: BaseException) -> None:
        sched = self.engine.scheduler
        for rid in list(sched.requests):
            self.engine.abort_request(rid)
            self._post(self._deliver_failure, rid, error)

    def _fail_unknown(self, error: BaseException) -> None:
        """A fire-and-forget command failed (e.g. add_request): fail queues with no engine request."""
        known = set(self.engine.scheduler.requests)
        for rid in list(self._queues):
            if rid not in known:
                self._post(self._deliver_failure, rid, error)

    # ---- loop side callbacks ---------------------------------------------------------------

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self._loop.call_soon_threadsafe(fn, *args)

    def _resolve(self, fut: asyncio.Future[Any], result: Any = None,
                 error: BaseException | None = None) -> None:
        def set_() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        self._post(set_)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _deliver_failure(self, request_id: str, error: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(_Failure(error))

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._queues):
            self._deliver_failure(rid, EngineDeadError(repr(error)))

    def _start_loads(self, loads: list[KvLoad]) -> None:
        for load in loads:
            task = asyncio.ensure_future(self._load(load))
            self._load_tasks.add(task)
            task.add_done_callback(self._load_tasks.discard)

    def _abort_loading(self, request_id: str) -> None:
        # Engine thread: mark aborted first so finish_kv_load frees instead of recomputing.
        self.engine.abort_request(request_id)
        self.engine.finish_kv_load(request_id, False)

    async def _load(self, load: KvLoad) -> None:
        ok = False
        rid = load.request.request_id
        try:
            if self.kv_loader is not None:
                ok = await self.kv_loader(load)
        except KvLoadAbort as e:
            self._submit(self._abort_loading, (rid,))
            self._deliver_failure(rid, e)
            return
        except Exception:
            logger.exception("KV load for %s failed", load.request.request_id)
            ok = False
        self._submit(self.engine.finish_kv_load, (rid, ok))
