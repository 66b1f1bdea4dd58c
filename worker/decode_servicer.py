"""`splitserve.v1.Decode`: a thin async servicer around one engine (decode or colocated role)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Span

from engine.async_engine import EngineDeadError, EngineOverloadedError, KvLoadAbort
from engine.llm_engine import LLMEngine
from engine_api.errors import EngineInputError
from engine_api.hashing import compute_block_hashes, prompt_hash
from engine_api.request_options import RemoteKv
from engine_api.sampling_params import SamplingParamsError
from kv_transfer.peers import KvPeers
from protos.splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from rpc import tracing
from worker.common import EngineBound, abort_traced, request_options
from worker.convert import (
    SPEC_METHOD_NAMES,
    InvalidRequest,
    check_prompt,
    check_request_id,
    finish_reason,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
)
from worker.embed import embed
from worker.kv import RemoteKvHandle, release_unpulled
from worker.tier_cache import TierPrefixCache
from worker.tier_metrics import fill_tier_report

KV_PULL_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


class DecodeServicer(EngineBound, decode_pb2_grpc.DecodeServicer):
    def __init__(self, kv_metadata: Sequence[tuple[str, str]] = (), pulls_kv: bool = True,
                 kv_peers: KvPeers | None = None) -> None:
        """kv_metadata: sent with the lease releases this servicer makes (the credential).
        pulls_kv: False on a prefill worker, whose engine decodes whole requests only when no
        decode worker is left (the gateway's prefill_only mode): a kv_handle is not pulled
        there (recomputed, or INVALID_ARGUMENT under KV_FAILURE_POLICY_FAIL). kv_peers: the
        addresses KV may be pulled from (--kv-peers); a handle naming another is refused before
        any connection (recomputed, or PERMISSION_DENIED under KV_FAILURE_POLICY_FAIL), and
        counted. None: any address a handle names."""
        super().__init__()
        self.kv_peers = kv_peers
        self.kv_handles_refused = 0  # handles naming an address outside kv_peers
        self._kv_metadata = tuple(kv_metadata)
        self._pulls_kv = pulls_kv
        self._releases: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks alive
        # Colocated role: CPU/Redis prefix tiers under the engine's cache, when configured.
        self.tiers: TierPrefixCache | None = None

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        # A server span under the gateway's `decode` span (W3C traceparent in the metadata);
        # never made current (this is an async generator), passed on to the KV pull instead.
        with tracing.server_span("splitserve.decode", context,
                                 _decode_attributes(request)) as span:
            # aclosing: closing this generator runs the inner one's cleanup (engine abort,
            # lease release) now rather than at garbage collection.
            async with contextlib.aclosing(self._decode(request, context, span)) as responses:
                async for response in responses:
                    yield response

    async def _decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext,
                      span: Span) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        aengine = await self.engine_or_abort(context)
        if await self._refuses_peer(request):
            if request.kv_failure_policy == decode_pb2.KV_FAILURE_POLICY_FAIL:
                await abort_traced(context, span, grpc.StatusCode.PERMISSION_DENIED,
                                   "the KV handle names an address that is not a KV peer")
            request.ClearField("kv_handle")  # recomputed here; nothing dials its address
            request.kv_failure_policy = decode_pb2.KV_FAILURE_POLICY_RECOMPUTE
            refused_handle = True
        else:
            refused_handle = False
        try:
            rid = check_request_id(request.request_id)
            ids = check_prompt(list(request.prompt_token_ids))
            params = sampling_from_proto(request.sampling)
            given = list(request.output_token_ids)
            if params.max_tokens is not None and len(given) >= params.max_tokens:
                raise InvalidRequest(f"output_token_ids already has {len(given)} tokens; "
                                     f"sampling.max_tokens is {params.max_tokens}")
            options = request_options(aengine.engine, request, params)
            lora, priority, salt = options.lora_name, options.priority, options.cache_salt
            remote = self._remote_kv(request, ids, context, tracing.span_context(span), lora,
                                     salt)
        except InvalidRequest as e:
            await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tiers = self.tiers
        # An adapter's KV is keyed in the tiers by hashes under its own root, as in the cache.
        root = (aengine.engine.hash_root(lora, salt) if lora is not None or salt is not None
                else None)
        if lora is not None:
            span.set_attribute("splitserve.lora_name", lora)
        if priority:
            span.set_attribute("splitserve.priority", priority)
        pulled = remote is not None  # the prompt's KV comes from a prefill worker
        if (remote is None and tiers is not None
                and params.prompt_logprobs is None):  # a prompt to be scored is computed here
            # No KV from a prefill worker (colocated, a resumed stream, or a handle not usable):
            # the prompt's prefix from the tiers where the GPU cache lost it.
            remote = await tiers.plan(ids, root, tracing.span_context(span))
            if remote is not None:
                span.set_attribute("splitserve.tier_tokens", remote.num_tokens)
        # The prompt's full blocks a prefill worker saved to the tiers itself: not saved again.
        saved_elsewhere = len(ids) // aengine.engine.config.cache.block_size if pulled else 0
        started = time.perf_counter()
        n_out = len(given)
        generated: list[int] = []
        # A num_speculative_tokens above the engine's limit fails in `generate`
        # (EngineInputError -> INVALID_ARGUMENT below), before anything is queued.
        refused = False  # shed for load: the lease stays for the next worker (`finally`)
        try:
            # decode_here: a prefill-role engine (prefill_only mode) decodes it too.
            async for out in aengine.generate(rid, ids, dataclasses.replace(
                    options, remote_kv=remote, decode_here=True)):
                n_out += len(out.new_token_ids)
                if tiers is not None:  # saved with the prompt when the request ends
                    if not generated and not given and remote is None:  # computed here
                        tiers.observe_prefill(len(ids), out.num_cached_tokens,
                                              time.perf_counter() - started)
                    generated.extend(out.new_token_ids)
                chunk = decode_pb2.DecodeChunk(
                    token_ids=out.new_token_ids,
                    logprobs=[logprob_to_proto(lp) for lp in out.new_logprobs])
                if out.prompt_logprobs is not None:
                    chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
                yield decode_pb2.DecodeResponse(chunk=chunk)
                if out.finished:
                    if tiers is not None:  # every token's KV but the last one's exists
                        tiers.spawn_save_tokens([*ids, *given, *generated][:-1], root,
                                                saved_elsewhere)
                    recomputed = remote is None or (
                        isinstance(remote.handle, RemoteKvHandle) and remote.handle.failed)
                    span.set_attribute("splitserve.output_tokens", n_out)
                    span.set_attribute("splitserve.cached_tokens", out.num_cached_tokens)
                    recomputed = refused_handle or (recomputed and request.HasField("kv_handle"))
                    span.set_attribute("splitserve.kv_recomputed", recomputed)
                    yield decode_pb2.DecodeResponse(complete=decode_pb2.DecodeComplete(
                        finish_reason=finish_reason(out), num_output_tokens=n_out,
                        kv_recomputed=recomputed,
                        num_cached_tokens=out.num_cached_tokens))
        except KvLoadAbort as e:
            await abort_traced(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
        except (EngineInputError, SamplingParamsError, ValueError) as e:
            await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await abort_traced(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
        except EngineOverloadedError as e:  # load shedding: the gateway tries another worker
            refused = True
            await abort_traced(context, span, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            # Cancelled (client gone) before the KV load began, or the pull failed (partial or
            # corrupt KV, recomputed): the prefill worker would otherwise hold the lease (and
            # its blocks) until it expires. A request refused for load (nothing pulled) leaves
            # it to the next decode worker the gateway tries, which pulls it instead.
            if (remote is not None and isinstance(remote.handle, RemoteKvHandle)
                    and not refused):
                self._release_unpulled(remote.handle)

    async def _refuses_peer(self, request: decode_pb2.DecodeRequest) -> bool:
        """Whether the request's KV handle names an address outside --kv-peers (logged and
        counted: a misconfigured list or a forged handle)."""
        if self.kv_peers is None or not self._pulls_kv or not request.HasField("kv_handle"):
            return False
        problem = await self.kv_peers.refusal(request.kv_handle.worker_address)
        if problem is None:
            return False
        self.kv_handles_refused += 1
        log.warning("request %s: %s; not pulled", request.request_id[:64], problem)
        return True

    def load_report(self, role: str) -> common_pb2.LoadReport:
        report = super().load_report(role)
        report.kv_handles_refused = self.kv_handles_refused
        return report

    def _release_unpulled(self, handle: RemoteKvHandle) -> None:
        """Release the prefill lease unless a whole pull took it (the loader releases then)."""
        if handle.started and not handle.failed:
            return
        task = asyncio.ensure_future(release_unpulled(handle, self._kv_metadata))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _remote_kv(self, request: decode_pb2.DecodeRequest, ids: list[int],
                   context: grpc.aio.ServicerContext,
                   trace_parent: Context | None = None,
                   lora: str | None = None, salt: str | None = None) -> RemoteKv | None:
        if not request.HasField("kv_handle"):
            return None
        if not self._pulls_kv:
            if request.kv_failure_policy == decode_pb2.KV_FAILURE_POLICY_FAIL:
                raise InvalidRequest("this worker pulls no KV (a prefill worker decoding)")
            return None  # recompute locally
        assert self.aengine is not None
        problem = _handle_problem(request.kv_handle, ids, self.aengine.engine, lora, salt)
        if problem is not None:
            if request.kv_failure_policy == decode_pb2.KV_FAILURE_POLICY_FAIL:
                raise InvalidRequest(problem)
            return None  # recompute locally
        remaining = context.time_remaining()
        timeout = min(KV_PULL_TIMEOUT_S, remaining) if remaining is not None else KV_PULL_TIMEOUT_S
        return RemoteKv(len(ids), RemoteKvHandle(request.kv_handle, request.kv_failure_policy,
                                                 timeout, trace_parent=trace_parent))

    async def Embed(self, request: common_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.EmbedResponse:
        return await embed(await self.engine_or_abort(context), request, context)

    async def GetLoad(self, request: common_pb2.LoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        aengine = await self.engine_or_abort(context)  # UNAVAILABLE while loading
        report = self.load_report(aengine.engine.config.scheduler.role)
        fill_tier_report(report, self.tiers)
        return report


def _decode_attributes(request: decode_pb2.DecodeRequest) -> dict[str, int | str | bool]:
    attrs: dict[str, int | str | bool] = {
        "splitserve.request_id": request.request_id,
        "splitserve.prompt_tokens": len(request.prompt_token_ids),
        "splitserve.resumed_tokens": len(request.output_token_ids),
        "splitserve.kv_handle": request.HasField("kv_handle")}
    if request.HasField("num_speculative_tokens"):  # absent: the worker's default
        attrs["splitserve.num_speculative_tokens"] = request.num_speculative_tokens
    if request.speculative_method in SPEC_METHOD_NAMES:
        attrs["splitserve.speculative_method"] = SPEC_METHOD_NAMES[request.speculative_method]
    return attrs


def _handle_problem(h: common_pb2.KvHandle, ids: list[int], eng: LLMEngine,
                    lora: str | None = None, salt: str | None = None) -> str | None:
    """Why the KV a handle names cannot be this prompt's, or None. The full blocks' chained
    hashes (rooted in the fingerprint, or in the request's LoRA adapter's root) must equal this
    prompt's, and so must the prompt hash, which also covers the partial last block: a handle
    of another prompt of the same length, or of the same prompt under another adapter, would
    otherwise be decoded from silently."""
    block_size = eng.config.cache.block_size
    if h.fingerprint != eng.fingerprint:
        return "kv_handle.fingerprint does not match this worker's model"
    if h.block_size != block_size:
        return f"kv_handle.block_size {h.block_size} != {block_size}"
    if h.num_tokens != len(ids):
        return f"kv_handle.num_tokens {h.num_tokens} != prompt length {len(ids)}"
    if not h.worker_address or not h.request_id:
        return "kv_handle needs worker_address and request_id"
    if list(h.block_hashes) != compute_block_hashes(eng.hash_root(lora, salt), ids, block_size):
        return ("kv_handle.block_hashes do not match the prompt's blocks (KV of another prompt, "
                "LoRA adapter or cache salt)")
    if h.prompt_hash != prompt_hash(eng.prompt_key(lora, salt), ids):
        return ("kv_handle.prompt_hash does not match this prompt (KV of another prompt, or a "
                "handle without prompt_hash)")
    return None
