"""`splitserve.v1.Prefill`: a thin async servicer around one engine (prefill role)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
from opentelemetry.trace import Span

from engine.async_engine import EngineDeadError, EngineOverloadedError
from engine.outputs import StepOutput
from engine_api.errors import EngineInputError
from engine_api.hashing import prompt_hash
from engine_api.sampling_params import SamplingParamsError
from protos.splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from rpc import tracing
from rpc.auth import LeaseTickets
from worker.common import EngineBound, abort_traced, request_options
from worker.convert import (
    InvalidRequest,
    check_prompt,
    check_request_id,
    finish_reason,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from worker.embed import embed
from worker.tier_cache import TierPrefixCache
from worker.tier_metrics import fill_tier_report


class PrefillServicer(EngineBound, prefill_pb2_grpc.PrefillServicer):
    def __init__(self, kv_address: str, tickets: LeaseTickets) -> None:
        super().__init__()
        self.kv_address = kv_address  # where decode workers pull this worker's blocks
        self.tickets = tickets  # each handle's lease ticket (what its pulls carry)
        self.tiers: TierPrefixCache | None = None  # CPU/Redis prefix tiers, when configured

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        # A server span under the gateway's `prefill` span (W3C traceparent in the metadata).
        with tracing.server_span("splitserve.prefill", context, {
                "splitserve.request_id": request.request_id,
                "splitserve.prompt_tokens": len(request.prompt_token_ids)}) as span:
            response = await self._prefill(request, context, span)
            span.set_attribute("splitserve.cached_tokens", response.num_cached_tokens)
            span.set_attribute("splitserve.kv_handle", response.HasField("kv_handle"))
            return response

    async def _prefill(self, request: prefill_pb2.PrefillRequest,
                       context: grpc.aio.ServicerContext, span: Span
                       ) -> prefill_pb2.PrefillResponse:
        aengine = await self.engine_or_abort(context)
        try:
            rid = check_request_id(request.request_id)
            ids = check_prompt(list(request.prompt_token_ids))
            params = sampling_from_proto(request.sampling)
            options = request_options(aengine.engine, request, params)
        except InvalidRequest as e:
            await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        last: StepOutput | None = None
        tiers = self.tiers
        lora, priority, salt = options.lora_name, options.priority, options.cache_salt
        if lora is not None:
            span.set_attribute("splitserve.lora_name", lora)
        if priority:
            span.set_attribute("splitserve.priority", priority)
        # A prompt to be scored (prompt logprobs) is computed here whole: no tier prefix. An
        # adapter's prompt is looked up under its hashes (its own root); its lease's hashes,
        # which the save below writes under, are the same.
        root = (aengine.engine.hash_root(lora, salt) if lora is not None or salt is not None
                else None)
        remote_kv = (await tiers.plan(ids, root, tracing.span_context(span))
                     if tiers is not None and params.prompt_logprobs is None else None)
        if remote_kv is not None:
            span.set_attribute("splitserve.tier_tokens", remote_kv.num_tokens)
        started = time.perf_counter()
        try:
            async for out in aengine.generate(
                    rid, ids, dataclasses.replace(options, remote_kv=remote_kv)):
                last = out
        except (InvalidRequest, EngineInputError, SamplingParamsError, ValueError) as e:
            await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await abort_traced(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
        except EngineOverloadedError as e:  # load shedding: the gateway tries another worker
            await abort_traced(context, span, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except asyncio.CancelledError:
            # Nobody will pull this KV. The lease may exist even when its output never reached
            # us (granted on the engine thread just before the cancel); the abort queued by
            # `generate` runs first, so releasing after it leaves no lease either way.
            aengine.submit(aengine.engine.release_lease, rid)
            raise
        if last is None:
            await abort_traced(context, span, grpc.StatusCode.INTERNAL, "engine returned no output")
        assert last is not None
        if tiers is not None and remote_kv is None:  # computed here: the cost model's rate
            tiers.observe_prefill(len(ids), last.num_cached_tokens,
                                  time.perf_counter() - started)
        response = self._response(rid, ids, last, request.lease_ms, lora, salt)
        if tiers is not None and response.HasField("kv_handle"):
            tiers.spawn_save(list(response.kv_handle.block_hashes))
        return response

    def _response(self, rid: str, ids: list[int], out: StepOutput,
                  lease_ms: int, lora: str | None = None,
                  salt: str | None = None) -> prefill_pb2.PrefillResponse:
        assert self.aengine is not None
        eng = self.aengine.engine
        resp = prefill_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
            finish_reason=finish_reason(out) if not out.kv_held else common_pb2.FINISH_REASON_UNSPECIFIED)
        if out.new_logprobs:
            resp.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        if out.prompt_logprobs is not None:
            resp.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
        lease = eng.kv_access.lease(rid) if out.kv_held else None
        if lease is not None:
            remaining = max(0.0, lease.deadline - time.monotonic())
            if lease_ms:
                remaining = min(remaining, lease_ms / 1000.0)
            resp.kv_handle.CopyFrom(common_pb2.KvHandle(
                worker_address=self.kv_address, request_id=rid, block_hashes=lease.block_hashes,
                num_tokens=lease.num_tokens, num_blocks=len(lease.block_ids),
                lease_deadline_unix_ms=int((time.time() + remaining) * 1000),
                fingerprint=eng.fingerprint, block_size=eng.config.cache.block_size,
                # Binds the handle to the exact prompt, partial last block included.
                prompt_hash=prompt_hash(eng.prompt_key(lora, salt), ids),
                lease_ticket=self.tickets.ticket(rid)))
        return resp

    async def Embed(self, request: common_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.EmbedResponse:
        return await embed(await self.engine_or_abort(context), request, context)

    async def GetLoad(self, request: common_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        await self.engine_or_abort(context)  # UNAVAILABLE while loading: routers skip us
        report = self.load_report("prefill")
        fill_tier_report(report, self.tiers)
        return report
