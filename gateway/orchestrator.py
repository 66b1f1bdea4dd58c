"""The request lifecycle across prefill and decode workers (docs/architecture.md, "A request's way through the layers").

For each of the n completions of a job, concurrently:

    Prefill.Prefill ──first token──▶ client           (TTFT)
         │ kv_handle
         ▼
    Decode.Decode(kv_handle, prompt, [first]) ──tokens──▶ detokenize, stop strings ──▶ client
         │ UNAVAILABLE mid-stream
         ▼
    Decode.Decode(prompt, all tokens sent so far, no kv_handle)   (at most `decode_retries`)
A stream whose worker stops answering (SIGSTOP) resumes the same way (gateway/stream_watch.py).

A worker that refuses a call with RESOURCE_EXHAUSTED (full: it sheds load) is skipped for that
call and the next one picked (prefill and decode alike), until each worker of the pool refused:
then the request fails with RESOURCE_EXHAUSTED (`OverloadedError`, HTTP 429).

In colocated mode there is no prefill pool: decode gets the prompt alone and computes it. So it
does in the degraded modes (gateway/serving_mode.py): with no healthy prefill worker (or a
Prefill call that found its pool down) the request goes whole to a decode worker; with no
healthy decode worker, whole to a prefill worker's Decode service. A Decode call whose pool
has no healthy worker left (the last one died mid-stream) resumes once in the other pool.
Every Decode call carries the speculative policy's choice for the worker it goes to
(gateway/spec_policy.py): the proposer and drafts per step that pay for that worker's batch at
its load, from its measured step cost and acceptance.
Cancelling the consumer of `Orchestrator.generate` cancels every downstream call, so workers
free their KV. Python gRPC does not propagate deadlines: each call gets the time remaining.

The prefill lease is the gateway's to drop whenever no decode worker will pull it: decode
cancelled or failed (possibly before its call reached a worker), a resume without the handle,
a decode worker that recomputed instead of pulling. `KvTransfer.Release` is idempotent, so
releasing a lease a decode worker already pulled (and released) is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from gateway.admission import RequestLimit
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, status_code_from_int
from gateway.generation import (
    Event,
    Finished,
    GenerationJob,
    TokenDelta,
    completion_sampling,
    time_remaining,
    unscored,
)
from gateway.metrics import GatewayMetrics
from gateway.request_metrics import CompletionTiming
from gateway.request_span import output_constraint, record_usage, request_attributes
from gateway.router import Attempts, Router, Worker, WorkerPool, call_routed
from gateway.serving_mode import ServingModes
from gateway.spec_metrics import spec_attributes
from gateway.spec_policy import SpecDecision, SpecPolicy, request_class
from gateway.stream_watch import WorkerStalled, stall_after_s, watched, watched_answer
from gateway.tokenization import DetokenizerLike, TokenizerLike, make_detokenizer
from protos.splitserve.v1 import common_pb2, decode_pb2, kv_transfer_pb2, prefill_pb2
from rpc import tracing

log = logging.getLogger(__name__)

_FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
_RELEASE_TIMEOUT_S = 2.0
_LOST_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,  # a lease
                grpc.StatusCode.CANCELLED)  # may have been granted, its answer lost


@dataclass(slots=True)
class _Completion:
    """Per-completion state: tokens sent so far and the detokenizer that saw them."""

    index: int
    detok: DetokenizerLike
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    kv_handle: common_pb2.KvHandle | None = None   # prefill lease not yet handed off or dropped
    trace_parent: Context | None = None           # the request's GenAI span (`chat MODEL`, `text_completion MODEL`)
    stop_reason: str | None = None
    last_emit: float | None = None
    scores_prompt: bool = False   # its prompt logprobs are asked for and have not arrived yet
    timing: CompletionTiming | None = None  # when it reached each phase (request metrics)
    whole: bool = True            # no prefill ran: the decode worker computes the prompt
    request_class: str | None = None  # the speculation policy's class, once read (resumes reuse it)


class Orchestrator:
    """Runs jobs against the worker pools. Stateless between jobs; safe to share on one loop."""

    def __init__(self, config: GatewayConfig, router: Router, tokenizer: TokenizerLike,
                 metrics: GatewayMetrics, limit: RequestLimit) -> None:
        self._config = config
        self._router = router
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._limit = limit
        self._background: set[asyncio.Task[None]] = set()
        self.modes = ServingModes(router, metrics.registry)  # which pools serve a request now
        self._spec_policy = SpecPolicy(config)

    def generate(self, job: GenerationJob) -> AsyncGenerator[Event, None]:
        """Events of all n completions, interleaved; raises `GatewayError` if one fails.

        The request holds a place of the gateway's `RequestLimit` from the first `anext`
        (refused there, OverloadedError, when there is none) until the iterator ends.
        Closing or cancelling the iterator cancels the downstream gRPC calls.
        """
        return self._limit.admitted(self._job_events(job))

    def generate_batch(self, jobs: Sequence[GenerationJob]) -> AsyncGenerator[Event, None]:
        """Events of several jobs (a batch of prompts in one request), interleaved, their
        completions numbered across the batch in order: job i's completion j is completion
        (n of the jobs before i) + j. Raises `GatewayError` if one fails; closing or cancelling
        the iterator cancels them all. One request: one place of the `RequestLimit`, as
        `generate`. One job goes as `generate` (no merging hop for every event of the usual
        request)."""
        if len(jobs) == 1:
            return self.generate(jobs[0])
        return self._limit.admitted(self._generate_merged(jobs))

    async def _job_events(self, job: GenerationJob) -> AsyncGenerator[Event, None]:
        """`generate`'s events, outside the request limit."""
        queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()
        if self._config.log_requests:
            log.info("request %s: %d prompt tokens, n=%d, max_tokens=%d, temperature=%g, "
                     "top_p=%g, seed=%s", job.request_id, len(job.prompt_token_ids), job.n,
                     job.sampling.max_tokens, job.sampling.temperature, job.sampling.top_p,
                     job.sampling.seed if job.sampling.HasField("seed") else None)
        # One GenAI client span per request; completions' prefill/decode spans are its
        # children (passed explicitly: the completions run in their own tasks).
        name = f"{job.operation} {self._config.served_model_name}"  # GenAI span name
        with tracing.traced_span(name, parent=None, kind=SpanKind.CLIENT,
                                 attributes=request_attributes(job, self._config.served_model_name)) as span:
            parent = tracing.span_context(span)
            tasks = [asyncio.create_task(self._run_guarded(job, i, queue, parent))
                     for i in range(job.n)]
            self._metrics.num_requests_in_flight.inc()
            constraint = output_constraint(job)
            if constraint is not None:
                self._metrics.structured_output_requests.labels(constraint=constraint).inc()
            if job.tool_choice is not None:
                self._metrics.tool_call_requests.labels(tool_choice=job.tool_choice).inc()
            finished: list[Finished] = []
            sent_tokens = 0
            try:
                async with contextlib.aclosing(_fan_in(queue, tasks)) as events:
                    async for event in events:
                        if isinstance(event, Finished):
                            finished.append(event)
                        elif isinstance(event, TokenDelta) and event.token_ids:
                            if not sent_tokens:
                                span.set_attribute("gen_ai.response.time_to_first_chunk",
                                                   time.monotonic() - job.arrival_time)
                            sent_tokens += len(event.token_ids)
                        yield event
            except GeneratorExit:
                if len(finished) < job.n:  # the client went away: the rest are aborted
                    self._metrics.request_success.labels(finished_reason="abort").inc(
                        job.n - len(finished))
                    raise
                # Closed after its last event: a finished request, not a cancelled one.
            except asyncio.CancelledError:
                self._metrics.request_success.labels(finished_reason="abort").inc(
                    job.n - len(finished))
                raise
            finally:
                record_usage(span, job, finished, sent_tokens)
                self._metrics.num_requests_in_flight.dec()

    async def _generate_merged(self, jobs: Sequence[GenerationJob]
                               ) -> AsyncGenerator[Event, None]:
        queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

        async def pump(job: GenerationJob, offset: int) -> None:
            try:
                async for event in self._job_events(job):
                    queue.put_nowait(dataclasses.replace(event, index=event.index + offset))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)
            queue.put_nowait(None)

        offsets = itertools.accumulate((j.n for j in jobs[:-1]), initial=0)
        tasks = [asyncio.create_task(pump(job, offset))
                 for job, offset in zip(jobs, offsets, strict=True)]
        async with contextlib.aclosing(_fan_in(queue, tasks)) as events:
            async for event in events:
                yield event

    async def _run_guarded(self, job: GenerationJob, index: int,
                           queue: asyncio.Queue[Event | BaseException | None],
                           trace_parent: Context | None = None) -> None:
        try:
            await self._run_completion(job, index, queue, trace_parent)
            queue.put_nowait(None)
        except GatewayError as err:
            self._metrics.request_failure.labels(code=err.code.name).inc()
            queue.put_nowait(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a bug must reach the client as an error, never a hang
            log.exception("completion %s/%d failed", job.request_id, index)
            self._metrics.request_failure.labels(code="INTERNAL").inc()
            queue.put_nowait(GatewayError(grpc.StatusCode.INTERNAL, f"internal error: {err}"))

    # -- one completion --------------------------------------------------------------------
    async def _run_completion(self, job: GenerationJob, index: int,
                              queue: asyncio.Queue[Event | BaseException | None],
                              trace_parent: Context | None = None) -> None:
        state = _Completion(index, make_detokenizer(
            self._tokenizer, job.prompt_token_ids, skip_special_tokens=job.skip_special_tokens,
            stop=job.stop, include_stop_str_in_output=job.include_stop_str_in_output),
            trace_parent=trace_parent)
        sampling = completion_sampling(job.sampling, index)
        state.scores_prompt = sampling.HasField("prompt_logprobs")
        state.timing = CompletionTiming(job.arrival_time, first_call=time.monotonic())
        finish: str | None = None
        prefill = await self._prefill_unless_degraded(job, state, sampling)
        if prefill is not None:
            state.whole = False
            state.num_cached_tokens = prefill.num_cached_tokens
            state.kv_handle = prefill.kv_handle if prefill.HasField("kv_handle") else None
            logprobs = [prefill.logprob] if prefill.HasField("logprob") else []
            finish = self._accept(job, state, [prefill.first_token_id], logprobs, queue,
                                  prefill.prompt_logprobs)
            finish = finish or _FINISH_NAMES.get(prefill.finish_reason)
            if finish is not None:
                # Decode will never pull this KV: free the lease now rather than at expiry.
                self._drop_kv_handle(state)
        if finish is None:
            try:
                finish = await self._traced_decode(job, state, sampling, queue)
            except BaseException:
                # Cancelled (client gone) or failed, maybe before the Decode call reached a
                # worker: no decode worker may ever pull (or release) the lease.
                self._drop_kv_handle(state)
                raise
        if state.stop_reason is None:
            # EOS / stop token / length: release text held back for a possible stop string.
            tail = state.detok.finish().text_delta
            if tail:
                queue.put_nowait(TokenDelta(state.index, [], tail, []))
        self._finish(job, state, finish, queue)

    async def _prefill_unless_degraded(self, job: GenerationJob, state: _Completion,
                                       sampling: common_pb2.SamplingParams
                                       ) -> prefill_pb2.PrefillResponse | None:
        """The Prefill call; None when the request goes whole to one pool instead: not
        disaggregated now, or its Prefill found the prefill pool down (UNAVAILABLE after the
        retry) while a decode worker is healthy (nothing reached the client yet)."""
        if not self.modes.prefills():
            return None
        try:
            return await self._traced_prefill(job, state, sampling)
        except GatewayError as err:
            if err.code != grpc.StatusCode.UNAVAILABLE or not self._router.decode.num_healthy:
                raise
            log.warning("prefill of %s failed (%s); computing it whole on a decode worker",
                        job.request_id, err.message)
            return None

    async def _traced_prefill(self, job: GenerationJob, state: _Completion,
                              sampling: common_pb2.SamplingParams) -> prefill_pb2.PrefillResponse:
        with tracing.traced_span("prefill", parent=state.trace_parent, kind=SpanKind.CLIENT,
                                 attributes={"splitserve.completion_index": state.index}) as span:
            response = await self._prefill(job, state.index, sampling,
                                           tracing.inject_metadata(tracing.span_context(span)))
            span.set_attribute("splitserve.cached_tokens", response.num_cached_tokens)
            span.set_attribute("splitserve.kv_handle", response.HasField("kv_handle"))
            return response

    async def _traced_decode(self, job: GenerationJob, state: _Completion,
                             sampling: common_pb2.SamplingParams,
                             queue: asyncio.Queue[Event | BaseException | None]) -> str:
        with tracing.traced_span("decode", parent=state.trace_parent, kind=SpanKind.CLIENT,
                                 attributes={"splitserve.completion_index": state.index}) as span:
            finish = await self._decode(job, state, sampling, queue,
                                        tracing.inject_metadata(tracing.span_context(span)), span)
            span.set_attribute("splitserve.output_tokens", len(state.output_ids))
            return finish

    @staticmethod
    def _prefix_hashes(pool: WorkerPool, job: GenerationJob) -> list[bytes]:
        """The prompt's block hashes for prefix routing (a LoRA adapter's request: chained from
        the adapter's root, as its workers hash its KV)."""
        return pool.prompt_hashes(job.prompt_token_ids, job.block_hashes, job.lora_name,
                                  job.cache_salt)

    async def _prefill(self, job: GenerationJob, index: int, sampling: common_pb2.SamplingParams,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> prefill_pb2.PrefillResponse:
        """Prefill on the best worker; an UNAVAILABLE worker is retried once on another."""
        assert self._router.prefill is not None  # not colocated
        request = prefill_pb2.PrefillRequest(
            request_id=f"{job.request_id}-{index}", prompt_token_ids=job.prompt_token_ids,
            sampling=sampling, lora_name=job.lora_name, priority=job.priority,
            cache_salt=job.cache_salt)
        pool = self._router.prefill

        async def call(worker: Worker) -> prefill_pb2.PrefillResponse:
            try:
                response = await watched_answer(self._router.prefill_stub(worker).Prefill(
                    request, timeout=self._remaining(job), metadata=metadata), worker,
                    stall_after_s(worker.load, self._config.stream_stall_s),
                    self._config.liveness_timeout_s)
            except WorkerStalled as stalled:  # nothing reached the client: whole on decode
                pool.mark_failed(worker.address)
                self._release_in_background(common_pb2.KvHandle(
                    worker_address=worker.address, request_id=request.request_id))
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"prefill: {stalled}") from None
            except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
                # The worker may have granted the lease and sent a response we will never read
                # (its handler was no longer cancellable, or the answer was lost on the way: the
                # connection cut, the deadline passed). A prefill worker serves KvTransfer on
                # its own address; releasing a lease that does not exist is a no-op.
                if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() in _LOST_ANSWER:
                    self._release_in_background(common_pb2.KvHandle(
                        worker_address=worker.address, request_id=request.request_id))
                raise
            pool.prefix_index.record(worker.address, response.kv_handle.block_hashes)
            return response

        return await call_routed(pool, self._prefix_hashes(pool, job), call, "prefill",
                                 job.lora_name)

    async def _decode(self, job: GenerationJob, state: _Completion,
                      sampling: common_pb2.SamplingParams,
                      queue: asyncio.Queue[Event | BaseException | None],
                      metadata: tuple[tuple[str, str], ...] = (), span: Span | None = None) -> str:
        """Stream decode tokens until finished; resume elsewhere if the worker dies or is full
        (refuses the call: load shedding), until every decode worker refused (429).

        The decode worker is chosen as a prefill worker is: the one believed to hold the
        longest prefix of the prompt, within the load-imbalance bound. It then pulls only the
        blocks it lacks, and colocated workers (no prefill pool) compute only those."""
        pool = self.modes.decode_pool()
        hashes = self._prefix_hashes(pool, job)
        attempts = Attempts(pool)
        switched = False
        while True:
            try:
                worker = attempts.pick(hashes, job.lora_name)
            except GatewayError:
                other = None if switched else self.modes.fallback_pool(pool, attempts)
                if other is None:
                    raise
                pool, attempts, switched = other, Attempts(other), True
                hashes = self._prefix_hashes(pool, job)
                continue
            try:
                return await self._decode_on(worker, job, state, sampling, queue, metadata, span,
                                             pool.role)
            except grpc.aio.AioRpcError as err:
                if not attempts.retry(worker, err, max_failures=self._config.decode_retries):
                    raise GatewayError.from_rpc(err, "decode") from None
                self._before_decode_retry(worker, job, state, err.code())
            except WorkerStalled as stalled:  # stopped, not dead: as good as dead to the stream
                if not attempts.abandon(worker, max_failures=self._config.decode_retries):
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"decode: {stalled}") from None
                self._metrics.decode_stalls.inc()
                self._before_decode_retry(worker, job, state, grpc.StatusCode.UNAVAILABLE)
            finally:
                pool.done(worker)

    def _request_class(self, job: GenerationJob) -> str:
        """The job's class for the speculation policy (its prompt's last 2,048 tokens read
        back as text: a code prompt drafts well)."""
        text = self._tokenizer.decode(job.prompt_token_ids[-2048:])
        return request_class(job.prompt_token_ids, job.tool_choice is not None, text)

    def _before_decode_retry(self, worker: Worker, job: GenerationJob, state: _Completion,
                             code: grpc.StatusCode) -> None:
        """`worker` failed (UNAVAILABLE, or stopped answering) or was full
        (RESOURCE_EXHAUSTED); the completion goes on elsewhere."""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Refused before anything ran there: the lease is still the prefill worker's (a
            # full decode worker leaves it), so the next decode worker pulls it. If every one
            # is full, the request's failure path releases it.
            return
        log.warning("decode worker %s failed (%s); resuming %s after %d tokens",
                    worker.address, code.name, job.request_id, len(state.output_ids))
        self._metrics.decode_resumes.inc()
        # The next worker computes prompt + tokens sent so far: nobody will pull the lease (the
        # failed worker may have; releasing again is harmless).
        self._drop_kv_handle(state)

    async def _decode_on(self, worker: Worker, job: GenerationJob, state: _Completion,
                         sampling: common_pb2.SamplingParams,
                         queue: asyncio.Queue[Event | BaseException | None],
                         metadata: tuple[tuple[str, str], ...] = (),
                         span: Span | None = None, pool_role: str = "decode") -> str:
        # Decided here, for this worker: no await since `pick`, so its load is the one the
        # router just routed on (a resume on another worker decides again).
        if state.request_class is None:  # the prompt is read back as text once, not per call
            state.request_class = self._request_class(job)
        spec = self._spec_policy.decide(worker, state.request_class)
        try:
            return await self._decode_call(worker, job, state, sampling, queue, spec,
                                           metadata, span, pool_role)
        finally:
            self._spec_policy.release(worker.address, spec)

    async def _decode_call(self, worker: Worker, job: GenerationJob, state: _Completion,
                           sampling: common_pb2.SamplingParams,
                           queue: asyncio.Queue[Event | BaseException | None],
                           spec: SpecDecision, metadata: tuple[tuple[str, str], ...],
                           span: Span | None, pool_role: str) -> str:
        self._metrics.observe_spec_decision(worker.address, spec)
        if span is not None:  # the last call's, when the completion was resumed
            for name, value in spec_attributes(spec).items():
                span.set_attribute(name, value)
        request = decode_pb2.DecodeRequest(
            # On a prefill worker the Prefill's id may still name its lease there.
            request_id=f"{job.request_id}-{state.index}"
                       + ("-whole" if pool_role == "prefill" else ""),
            prompt_token_ids=job.prompt_token_ids,
            output_token_ids=state.output_ids,
            # The prompt is scored once: by the prefill worker, or by the first decode worker
            # (colocated) — not again on a resume, nor where the prompt's KV is pulled.
            sampling=sampling if state.scores_prompt else unscored(sampling),
            kv_failure_policy=(decode_pb2.KV_FAILURE_POLICY_FAIL
                               if self._config.kv_failure_policy == "fail"
                               else decode_pb2.KV_FAILURE_POLICY_RECOMPUTE),
            # Always set, 0 included: absent would mean the worker's own default.
            num_speculative_tokens=spec.num_speculative_tokens,
            speculative_method=spec.method, speculative_class=spec.request_class,
            speculative_fixed=spec.reason == "always",
            lora_name=job.lora_name, priority=job.priority, cache_salt=job.cache_salt)
        if state.kv_handle is not None:
            request.kv_handle.CopyFrom(state.kv_handle)
        call = self._router.decode_stub(worker).Decode(request, timeout=self._remaining(job),
                                                       metadata=metadata)
        stall_s = stall_after_s(worker.load, self._config.stream_stall_s)
        try:
            async for response in watched(call, worker, stall_s, self._config.liveness_timeout_s):
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    self._metrics.request_phases.iteration_tokens.observe(
                        len(response.chunk.token_ids))
                    stop = self._accept(job, state, list(response.chunk.token_ids),
                                        list(response.chunk.logprobs), queue,
                                        response.chunk.prompt_logprobs)
                    if stop is not None:
                        return stop  # `finally` cancels the call: the worker frees the KV
                elif kind == "complete":
                    if state.whole:  # no prefill ran: the worker's own count
                        state.num_cached_tokens = response.complete.num_cached_tokens
                    if response.complete.kv_recomputed:
                        # The worker refused the handle (it does not release what it judged
                        # not to be this prompt's) or its pull failed: the lease is unused.
                        self._drop_kv_handle(state)
                    return _FINISH_NAMES.get(response.complete.finish_reason, "stop")
                elif kind == "error":
                    raise GatewayError(status_code_from_int(response.error.code),
                                       f"decode worker: {response.error.message}")
            raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                               "decode worker ended the stream without a completion")
        finally:
            call.cancel()  # no-op when the call already finished

    # -- tokens out ------------------------------------------------------------------------
    def _accept(self, job: GenerationJob, state: _Completion, token_ids: list[int],
                logprobs: list[common_pb2.TokenLogprob],
                queue: asyncio.Queue[Event | BaseException | None],
                prompt_logprobs: common_pb2.PromptLogprobs | None = None) -> str | None:
        """Detokenize new tokens and emit them; returns "stop" when a stop string matched.
        `prompt_logprobs`: what came with them; the first tokens of a completion that scores
        its prompt carry its prompt's."""
        if not token_ids:
            return None
        scored = None
        if state.scores_prompt:
            scored, state.scores_prompt = prompt_logprobs or common_pb2.PromptLogprobs(), False
        result = state.detok.add_tokens(token_ids)
        state.output_ids.extend(token_ids)
        now = time.monotonic()
        if state.last_emit is None:
            self._metrics.time_to_first_token.observe(now - job.arrival_time)
            if state.timing is not None:
                state.timing.first_token = now
        else:
            self._metrics.inter_token_latency.observe(now - state.last_emit)
        state.last_emit = now
        queue.put_nowait(TokenDelta(state.index, token_ids, result.text_delta,
                                    logprobs if job.wants_logprobs else [], scored))
        matched = result.stop_matched
        if matched:
            state.stop_reason = matched if isinstance(matched, str) else None
            return "stop"
        return None

    def _finish(self, job: GenerationJob, state: _Completion, finish_reason: str,
                queue: asyncio.Queue[Event | BaseException | None]) -> None:
        self._metrics.request_success.labels(finished_reason=finish_reason).inc()
        self._metrics.generation_tokens.inc(len(state.output_ids))
        now = time.monotonic()
        self._metrics.e2e_request_latency.observe(now - job.arrival_time)
        if state.timing is not None:
            self._metrics.request_phases.observe_finished(
                state.timing, now, len(job.prompt_token_ids), len(state.output_ids))
        queue.put_nowait(Finished(state.index, finish_reason, state.stop_reason,
                                  len(job.prompt_token_ids), len(state.output_ids),
                                  state.num_cached_tokens))

    # -- helpers ---------------------------------------------------------------------------
    def _remaining(self, job: GenerationJob) -> float:
        return time_remaining(job.arrival_time, self._config.request_timeout_s)

    def _drop_kv_handle(self, state: _Completion) -> None:
        """Release the completion's prefill lease (if any) and forget the handle."""
        self._release_in_background(state.kv_handle)
        state.kv_handle = None

    def _release_in_background(self, kv_handle: common_pb2.KvHandle | None) -> None:
        """Best-effort `KvTransfer.Release` of a lease decode will never pull (expiry is the backstop)."""
        if kv_handle is None or not kv_handle.worker_address or not kv_handle.request_id:
            return
        task = asyncio.create_task(self._release(kv_handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, kv_handle: common_pb2.KvHandle) -> None:
        stub = self._router.kv_transfer_stub(kv_handle.worker_address)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Release(kv_transfer_pb2.ReleaseRequest(request_id=kv_handle.request_id),
                               timeout=_RELEASE_TIMEOUT_S)

    async def drain_background(self) -> None:
        """Wait for pending lease releases (used on shutdown)."""
        await asyncio.gather(*self._background, return_exceptions=True)


async def _fan_in(queue: asyncio.Queue[Event | BaseException | None],
                  producers: Sequence[asyncio.Task[None]]) -> AsyncGenerator[Event, None]:
    """The events `producers` put on `queue` until each has put its None; an exception one put
    is raised here. Closing this (or its failing) cancels the producers and waits for them."""
    try:
        remaining = len(producers)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in producers:
            t.cancel()
        await asyncio.gather(*producers, return_exceptions=True)
