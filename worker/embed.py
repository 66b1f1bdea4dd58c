"""`Embed`, as the Prefill and the Decode services serve it (one implementation: a disaggregated
gateway sends embeddings to its prefill pool, a colocated one to its only pool): the prompt
computed and pooled by the engine (engine/pooling.py), validated and traced as `Prefill` is.

Cancelling the call (client gone, deadline) aborts the engine request, which frees its blocks;
an embedding holds no lease, so nothing else is left behind."""

from __future__ import annotations

import grpc

from engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from engine.outputs import StepOutput
from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolingParamsError
from protos.splitserve.v1 import common_pb2
from rpc import tracing
from rpc.embedding_wire import pack_float32
from worker.common import abort_traced, request_options
from worker.convert import InvalidRequest, check_prompt, check_request_id, pooling_from_proto


async def embed(aengine: AsyncEngine, request: common_pb2.EmbedRequest,
                context: grpc.aio.ServicerContext) -> common_pb2.EmbedResponse:
    """The embedding of `request`'s prompt, or the call aborted with INVALID_ARGUMENT (bad
    request), UNAVAILABLE (engine gone), RESOURCE_EXHAUSTED (engine full: load shedding) or
    INTERNAL."""
    # A server span under the gateway's `embed` span (W3C traceparent in the metadata).
    with tracing.server_span("splitserve.embed", context, {
            "splitserve.request_id": request.request_id,
            "splitserve.prompt_tokens": len(request.prompt_token_ids)}) as span:
        try:
            rid = check_request_id(request.request_id)
            ids = check_prompt(list(request.prompt_token_ids))
            options = request_options(aengine.engine, request, pooling_from_proto(request))
        except InvalidRequest as e:
            await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        last: StepOutput | None = None
        try:
            async for out in aengine.generate(rid, ids, options):
                last = out
        except (InvalidRequest, EngineInputError, PoolingParamsError, ValueError) as e:
            await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await abort_traced(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
        except EngineOverloadedError as e:
            await abort_traced(context, span, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if last is None or last.embedding is None:
            await abort_traced(context, span, grpc.StatusCode.INTERNAL,
                               "the engine finished the request without its embedding")
        assert last is not None and last.embedding is not None
        span.set_attribute("splitserve.cached_tokens", last.num_cached_tokens)
        span.set_attribute("splitserve.embedding_dimensions", len(last.embedding))
        return common_pb2.EmbedResponse(embedding=pack_float32(last.embedding),
                                        num_prompt_tokens=len(ids),
                                        num_cached_tokens=last.num_cached_tokens)
