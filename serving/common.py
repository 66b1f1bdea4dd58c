"""Servicer helpers shared by the prefill and decode roles."""

from __future__ import annotations

import grpc
from opentelemetry.trace import Span

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineInputError, LLMEngine
from protos.splitserve.v1 import common_pb2
from serving import tracing
from serving.convert import SPEC_METHOD_ENUMS, InvalidRequest
from serving.kv import GrpcKvLoader


class EngineBound:
    """Base of a servicer whose engine arrives after the server started (health gates it)."""

    def __init__(self) -> None:
        self.aengine: AsyncEngine | None = None

    def bind(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine

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
        return common_pb2.LoadReport(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.num_free_blocks, block_size=eng.config.cache.block_size,
            fingerprint=eng.fingerprint, role=role,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, num_leases=s.num_leases, num_blocks=s.num_blocks,
            spec_draft_tokens=s.spec_draft_tokens, spec_accepted_tokens=s.spec_accepted_tokens,
            speculative_methods=[SPEC_METHOD_ENUMS[m] for m in _own_first(eng)],
            kv_transports=_kv_transports(self.aengine),
            lora_adapters=list(eng.config.lora.names),
            lora_roots=[eng.hash_root(name) for name in eng.config.lora.names])


async def abort_traced(context: grpc.aio.ServicerContext, span: Span, code: grpc.StatusCode,
                       message: str) -> None:
    """Record the failure on the request's span, then end the RPC with `code`."""
    tracing.record_error(span, f"{code.name}: {message}")
    await context.abort(code, message)


def check_lora_name(engine: LLMEngine, name: str) -> str | None:
    """A request's `lora_name` ("" = the base model: None); InvalidRequest for an adapter the
    engine does not serve."""
    if not name:
        return None
    try:
        engine.lora_slot(name)
    except EngineInputError as e:
        raise InvalidRequest(str(e)) from None
    return name


def check_priority(engine: LLMEngine, priority: int) -> int:
    """A request's scheduling `priority`; InvalidRequest (the engine's message) for one this
    engine's policy does not take: any but 0 on an FCFS engine. Checked with the other fields,
    so that a refused request reads no prefix tier and pulls no KV."""
    try:
        engine.check_priority(priority)
    except EngineInputError as e:
        raise InvalidRequest(str(e)) from None
    return priority


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
