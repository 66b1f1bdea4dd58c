"""Embeddings, for both front doors (`POST /v1/embeddings`, `Gateway.Embed`): every input
tokenized and checked before any runs, then each embedded by its own `Embed` call, all at once,
on the worker the router picks as it picks a prefill worker (longest cached prefix, then load)
in the pool that computes prompts (colocated: the only one).

At most `MAX_EMBED_CALLS_IN_FLIGHT` of a request's calls run at once: a grpc.aio server
cancels calls beyond about 1,024 at once (a 2,048-input request, OpenAI's most, came back
CANCELLED), and a worker batches no more than its `max_num_seqs` (256 by default) per step
anyway.

An embedding's prompt fills the worker's prefix cache like any other prompt's, so the router
records it there as it does a prefill's. Failing or cancelling the request (a client gone)
cancels every call still running; the workers then free those requests' KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from engine_api.pooling_params import PoolingParams, PoolingParamsError
from gateway.errors import GatewayError
from gateway.generation import time_remaining
from gateway.openai_protocol import PromptInput
from gateway.router import Worker, call_routed
from gateway.state import GatewayState
from protos.splitserve.v1 import common_pb2
from rpc import tracing

log = logging.getLogger(__name__)

MAX_EMBED_CALLS_IN_FLIGHT = 256


@dataclass(frozen=True, slots=True)
class EmbeddingJob:
    """A validated, tokenized embeddings request: what `run_embeddings` runs."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    # What every input's call carries (pooling_type, normalize, dimensions, lora_name,
    # priority).
    pooling: common_pb2.EmbedRequest
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def refuse_classifier_embeddings(state: GatewayState) -> None:
    """A 400 for an embeddings request to a classifier, whose pooled output is class logits,
    not an embedding (vLLM serves such a model's /classify, /score and /rerank)."""
    labels = state.class_labels()
    if labels:
        raise GatewayError.invalid("model", f"this model is a classifier ({len(labels)} "
                                   "label(s)): it serves /v1/classify, /v1/score and "
                                   "/v1/rerank, not embeddings")


async def embedding_job(state: GatewayState, inputs: Sequence[PromptInput], *, request_id: str,
                        lora_name: str, priority: int = 0, dimensions: int | None = None,
                        normalize: bool | None = None,
                        truncate_prompt_tokens: int | None = None,
                        pooling_type: common_pb2.PoolingType.ValueType =
                        common_pb2.POOLING_TYPE_UNSPECIFIED,
                        param: str = "input", cache_salt: str = "") -> EmbeddingJob:
    """Check the pooling options (the engine's `PoolingParams` rules; the upper bound of
    `dimensions`, the model's hidden size, is the workers' to check) and tokenize each input,
    keeping its last `truncate_prompt_tokens` tokens (`Preprocessor.truncated`): input i is
    named `{param}.{i}` in errors (`param` alone for one input). `priority`: an int32, which
    the workers check against their scheduling policy; `cache_salt`: a checked salt, or none
    (empty)."""
    try:
        PoolingParams(normalize=normalize, dimensions=dimensions,
                      truncate_prompt_tokens=truncate_prompt_tokens)
    except PoolingParamsError as err:
        raise GatewayError.invalid(str(err).split(" ", 1)[0], str(err)) from None
    pre = state.preprocessor
    prompts: list[tuple[int, ...]] = []
    for i, prompt in enumerate(inputs):
        name = param if len(inputs) == 1 else f"{param}.{i}"
        ids = (await pre.encode_text(prompt, name) if isinstance(prompt, str)
               else pre.check_token_ids(prompt, name))
        ids = pre.truncated(ids, truncate_prompt_tokens)
        pre.check_prompt_len(len(ids), name, generates=False)
        prompts.append(tuple(ids))
    pooling = common_pb2.EmbedRequest(pooling_type=pooling_type, dimensions=dimensions or 0,
                                      lora_name=lora_name, priority=priority,
                                      cache_salt=cache_salt)
    if normalize is not None:
        pooling.normalize = normalize
    return EmbeddingJob(request_id, tuple(prompts), pooling)


async def run_embeddings(state: GatewayState, job: EmbeddingJob) -> list[common_pb2.EmbedResponse]:
    """Each input's embedding, in order; raises `GatewayError` when one fails (the others are
    cancelled). Counted and traced as a request: a `gen_ai.embeddings` span with a child per
    input's call; holds a place of the gateway's `RequestLimit` (OverloadedError when there is
    none)."""
    with state.limit.slot():  # refused here, before any worker is called, when full
        return await _run_embeddings(state, job)


async def _run_embeddings(state: GatewayState, job: EmbeddingJob
                          ) -> list[common_pb2.EmbedResponse]:
    metrics = state.metrics
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.request.model": job.pooling.lora_name or state.config.served_model_name,
        "splitserve.request_id": job.request_id, "splitserve.inputs": len(job.prompts)}
    if job.pooling.priority:
        attrs["splitserve.priority"] = job.pooling.priority
    with tracing.traced_span("gen_ai.embeddings", parent=None, kind=SpanKind.CLIENT,
                             attributes=attrs) as span:
        parent = tracing.span_context(span)
        calls = asyncio.Semaphore(MAX_EMBED_CALLS_IN_FLIGHT)
        tasks = [asyncio.create_task(_embed(state, job, i, parent, calls))
                 for i in range(len(job.prompts))]
        metrics.num_requests_in_flight.inc()
        try:
            responses = list(await asyncio.gather(*tasks))
        except GatewayError as err:
            metrics.request_failure.labels(code=err.code.name).inc()
            raise
        finally:
            metrics.num_requests_in_flight.dec()
            for task in tasks:  # one failed, or the request was cancelled: stop the rest
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        span.set_attribute("gen_ai.usage.input_tokens", job.num_prompt_tokens)
        metrics.request_success.labels(finished_reason="stop").inc(len(responses))
        metrics.e2e_request_latency.observe(time.monotonic() - job.arrival_time)
        return responses


async def _embed(state: GatewayState, job: EmbeddingJob, index: int, parent: Context,
                 calls: asyncio.Semaphore) -> common_pb2.EmbedResponse:
    """Input `index`'s `Embed` call on the router's choice (retried once elsewhere when that
    worker is UNAVAILABLE, and on each other worker in turn while they are full), once one
    of the request's `calls` is free."""
    async with calls:
        return await _embed_call(state, job, index, parent)


async def _embed_call(state: GatewayState, job: EmbeddingJob, index: int,
                      parent: Context) -> common_pb2.EmbedResponse:
    router = state.router
    pool = router.embed_pool
    prompt = job.prompts[index]
    request = common_pb2.EmbedRequest(request_id=f"{job.request_id}-{index}",
                                      prompt_token_ids=prompt)
    request.MergeFrom(job.pooling)
    with tracing.traced_span("embed", parent=parent, kind=SpanKind.CLIENT,
                             attributes={"splitserve.input_index": index}) as span:
        metadata = tracing.inject_metadata(tracing.span_context(span))

        async def call(worker: Worker) -> common_pb2.EmbedResponse:
            return await router.embed_stub(worker).Embed(
                request, timeout=time_remaining(job.arrival_time, state.config.request_timeout_s),
                metadata=metadata)

        lora = job.pooling.lora_name
        try:
            hashes = pool.prompt_hashes(prompt, lora_name=lora,
                                        cache_salt=job.pooling.cache_salt)
            response = await call_routed(pool, hashes, call, "embed", lora)
        except (GatewayError, asyncio.CancelledError):
            raise
        except Exception as err:  # a bug must reach the client as an error, never a hang
            log.exception("embedding %s-%d failed", job.request_id, index)
            raise GatewayError(grpc.StatusCode.INTERNAL, f"internal error: {err}") from None
        span.set_attribute("splitserve.cached_tokens", response.num_cached_tokens)
        return response
