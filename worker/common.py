"""Servicer helpers shared by the prefill and decode roles, and the RPCs both serve alike:
runtime LoRA adapter loading and unloading."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from opentelemetry.trace import Span

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolingParams
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams
from protos.splitserve.v1 import common_pb2, decode_pb2, prefill_pb2
from rpc import tracing
from rpc.limits import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS, lora_field_problem
from worker.convert import SPEC_METHOD_ENUMS, SPEC_METHOD_NAMES, InvalidRequest
from worker.kv import GrpcKvLoader
from worker.spec_report import spec_report

logger = logging.getLogger(__name__)

# The requests whose options `request_options` reads (each has lora_name, priority, cache_salt).
OptionsRequest = prefill_pb2.PrefillRequest | decode_pb2.DecodeRequest | common_pb2.EmbedRequest


class EngineBound:
    """Base of a servicer whose engine arrives after the server started (health gates it).

    Also serves `LoadLoRAAdapter` / `UnloadLoRAAdapter` for both roles (before the generated
    servicer base in the MRO, so these override its UNIMPLEMENTED stubs)."""

    def __init__(self) -> None:
        self.aengine: AsyncEngine | None = None
        # Each adapter's directory (start-time and runtime ones): an unload answers with it, so
        # that a caller undoing the unload can load the adapter back. Mutated on the loop only.
        self.lora_paths: dict[str, str] = {}
        # The adapters loaded through LoadLoRAAdapter and their directories (load reports'
        # `lora_paths`). Mutated on the loop only.
        self.runtime_lora_paths: dict[str, str] = {}

    def bind(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine
        self.lora_paths = dict(aengine.engine.config.lora.modules)

    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> common_pb2.LoadLoRAAdapterResponse:
        with tracing.server_span("splitserve.load_lora_adapter", context,
                                 _lora_attributes(request.lora_name)) as span:
            aengine = await self.engine_or_abort(context)
            name, path = request.lora_name, request.lora_path
            names = await _engine_call(context, span, aengine, _add_lora, name, path)
            self.lora_paths[name] = path  # the engine logged the load
            self.runtime_lora_paths[name] = path
            return common_pb2.LoadLoRAAdapterResponse(lora_adapters=names)

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> common_pb2.UnloadLoRAAdapterResponse:
        with tracing.server_span("splitserve.unload_lora_adapter", context,
                                 _lora_attributes(request.lora_name)) as span:
            aengine = await self.engine_or_abort(context)
            name = request.lora_name
            names = await _engine_call(context, span, aengine, _remove_lora, name)
            self.runtime_lora_paths.pop(name, None)
            return common_pb2.UnloadLoRAAdapterResponse(
                lora_adapters=names, lora_path=self.lora_paths.pop(name, ""))

    async def engine_or_abort(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        if self.aengine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        assert self.aengine is not None
        return self.aengine

    def load_report(self, role: str) -> common_pb2.LoadReport:
        if self.aengine is None:
            return common_pb2.LoadReport(role=role)
        s = self.aengine.stats()
        eng = self.aengine.engine
        names, roots = _lora_roots(eng)
        usage = eng.lora_requests()
        return common_pb2.LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.num_free_blocks, block_size=eng.config.cache.block_size,
            fingerprint=eng.fingerprint, role=role,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_leases=s.num_leases, num_blocks=s.num_blocks,
            spec_draft_tokens=s.spec_draft_tokens, spec_accepted_tokens=s.spec_accepted_tokens,
            speculative_methods=[SPEC_METHOD_ENUMS[m] for m in _own_first(eng)],
            kv_transports=_kv_transports(self.aengine),
            lora_adapters=names, lora_roots=roots,
            max_loras=eng.config.lora.max_loras if eng.runtime_lora else 0,
            lora_running=[usage.get(n, (0, 0))[0] for n in names],
            lora_waiting=[usage.get(n, (0, 0))[1] for n in names],
            class_labels=list(eng.class_labels),
            lora_paths=[self.runtime_lora_paths.get(n, "") for n in names],
            **spec_report(eng))


async def abort_traced(context: grpc.aio.ServicerContext, span: Span, code: grpc.StatusCode,
                       message: str) -> None:
    """Record the failure on the request's span, then end the RPC with `code`."""
    tracing.record_error(span, f"{code.name}: {message}")
    await context.abort(code, message)


def _lora_roots(engine: LLMEngine) -> tuple[list[str], list[bytes]]:
    """The engine's adapters and their KV hash roots. Read off the engine thread (racy, as
    `stats`): an adapter unloaded between the two reads is left out of this report alone."""
    names: list[str] = []
    roots: list[bytes] = []
    for name in engine.lora_names():
        try:
            roots.append(engine.hash_root(name))
        except EngineInputError:
            continue
        names.append(name)
    return names, roots


class _Refused(Exception):
    """An adapter update refused with `code` (raised on the engine thread, or before)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _lora_attributes(name: str) -> dict[str, str]:
    return {"splitserve.lora_name": name[:MAX_LORA_NAME_CHARS]}


def _add_lora(engine: LLMEngine, name: str, path: str) -> list[str]:
    """On the engine thread: load adapter `name` from `path`; the adapters after. The engine's
    message says what is wrong: FAILED_PRECONDITION when it takes no adapters at runtime at
    all, INVALID_ARGUMENT otherwise (the name, a free slot, the files)."""
    for problem in (lora_field_problem("lora_name", name, MAX_LORA_NAME_CHARS),
                    lora_field_problem("lora_path", path, MAX_LORA_PATH_CHARS)):
        if problem is not None:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
    runtime = engine.runtime_lora
    try:
        engine.add_lora(name, path)
    except EngineInputError as e:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT if runtime
                       else grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    return engine.lora_names()


def _remove_lora(engine: LLMEngine, name: str) -> list[str]:
    """On the engine thread: unload adapter `name`; the adapters after. NOT_FOUND for a name
    the engine does not serve; FAILED_PRECONDITION (the engine's message) when it takes no
    adapters at runtime or requests still use this one. Checked here, between steps, so that
    no request takes the adapter up between the check and the removal."""
    problem = lora_field_problem("lora_name", name, MAX_LORA_NAME_CHARS)
    if problem is not None:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
    names = engine.lora_names()
    if engine.runtime_lora and name not in names:
        raise _Refused(grpc.StatusCode.NOT_FOUND,
                       f"LoRA adapter {name!r} is not loaded on this worker (it serves "
                       f"{', '.join(map(repr, names)) or 'none'})")
    try:
        engine.remove_lora(name)
    except EngineInputError as e:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    return engine.lora_names()


async def _engine_call(context: grpc.aio.ServicerContext, span: Span, aengine: AsyncEngine,
                       fn: Callable[..., list[str]], *args: str) -> list[str]:
    """`fn(engine, *args)` on the engine thread; any failure ends the RPC with a status (a bad
    adapter never reaches the engine's step, and never takes the worker down)."""
    try:
        result: list[str] = await aengine.call(fn, aengine.engine, *args)
        return result
    except _Refused as e:
        await abort_traced(context, span, e.code, str(e))
    except (EngineInputError, ValueError, OSError) as e:  # the adapter's files, its name
        await abort_traced(context, span, grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except EngineDeadError as e:
        await abort_traced(context, span, grpc.StatusCode.UNAVAILABLE, str(e))
    except Exception as e:
        logger.exception("LoRA adapter update failed")
        await abort_traced(context, span, grpc.StatusCode.INTERNAL,
                           f"LoRA adapter update failed: {type(e).__name__}: {e}")
    raise AssertionError("unreachable: abort raises")


def request_options(engine: LLMEngine, request: OptionsRequest,
                    params: SamplingParams | PoolingParams) -> RequestOptions:
    """The `RequestOptions` of a Prefill, Decode or Embed request: `params` with its LoRA
    adapter ("" = the base model), scheduling priority and cache salt ("" = none), and a
    Decode's given output tokens and speculation (absent: the worker's own; an unknown method:
    the worker's own). InvalidRequest (the engine's message) for an adapter the engine does
    not serve, a priority its policy does not take (any but 0 on an FCFS engine) or a bad
    salt: checked before anything else, so that a refused request reads no prefix tier and
    pulls no KV. Remote KV joins later (`dataclasses.replace`), once it is known."""
    lora = request.lora_name or None
    given: list[int] | None = None
    spec: int | None = None
    method: str | None = None
    spec_class = ""
    fixed = False
    if isinstance(request, decode_pb2.DecodeRequest):
        spec_class = request.speculative_class
        fixed = request.speculative_fixed
        given = list(request.output_token_ids)
        spec = (request.num_speculative_tokens if request.HasField("num_speculative_tokens")
                else None)
        method = SPEC_METHOD_NAMES.get(request.speculative_method)
    try:
        engine.lora_slot(lora)
        engine.check_priority(request.priority)
        return RequestOptions(params, output_token_ids=given, num_speculative_tokens=spec,
                              speculative_method=method, speculative_class=spec_class,
                              speculative_fixed=fixed,
                              lora_name=lora,
                              priority=request.priority, cache_salt=request.cache_salt or None)
    except EngineInputError as e:
        raise InvalidRequest(str(e)) from None


def _own_first(engine: LLMEngine) -> list[str]:
    """The engine's speculative methods, its configured one first."""
    own = engine.config.speculative.method
    return sorted(engine.proposers, key=lambda m: m != own)


def _kv_transports(aengine: AsyncEngine) -> list[common_pb2.KvTransportStats]:
    """A decode worker's KV pulls so far, per way (none for the other roles)."""
    loader = aengine.kv_loader
    if not isinstance(loader, GrpcKvLoader):
        return []
    return [common_pb2.KvTransportStats(transport=name, pulls=st.pulls, bytes=st.bytes,
                                        seconds=st.seconds, block_runs=st.block_runs)
            for name, st in sorted(dict(loader.transport_stats).items())]  # a copy: atomic
