"""End-to-end harness: the real SmolLM2 engines behind real gRPC workers and a real gateway.

A pytest plugin (test modules load it with `pytest_plugins = ["tests.support.e2e_stack"]`, so its
session fixtures exist once for the whole run) plus helpers:

- `LoopThread`: one asyncio loop in a daemon thread. Workers, engines and gateways live on it;
  tests stay synchronous and talk to them over sockets (the `openai` client, httpx, sync gRPC
  stubs) or hand it a coroutine with `LoopThread.run(coro, timeout_s)`.
- `Stack`: prefill + decode workers (or one colocated worker) and a `GatewayServer` in front,
  all on 127.0.0.1 with ephemeral ports. The disaggregated stack's workers require the cluster
  secret `INTERNAL_TOKEN` (gateway -> workers carry it, decode -> prefill KV pulls their lease's
  ticket: every disaggregated test runs authenticated); the colocated one runs without (the default).
  Loading an engine takes ~5-20 s on 2 shared cores, so the fixtures `disagg_stack` and
  `colocated_stack` are session-scoped and shared by every e2e test; `loop_thread` runs them
  and stops everything at the end.
- Tool calling: `tools_gateway_server` (module-scoped), a second gateway in front of the
  disaggregated workers with `--tool-call-parser hermes` and the bundled ChatML tools template,
  and the tools the tests send (`WEATHER`, `TIME`, `FORCED_CALL`).

Every wait is bounded (`LOAD_TIMEOUT_S`, `IDLE_TIMEOUT_S`, gRPC/HTTP timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest

from decode_service.server import start_decode_worker
from engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    Role,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.llm_engine import LLMEngine
from engine_api.pooling_params import PoolerConfig
from engine_api.tokenizer import Tokenizer
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from gateway.tokenization import load_chat_template
from prefill_service.server import start_prefill_worker
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc.auth import bearer_metadata
from worker.server import WorkerHandle

T = TypeVar("T")


async def start_worker(config: EngineConfig, host: str, port: int, **kw: Any) -> WorkerHandle:
    """A prefill, decode or colocated worker for `config`'s role, as `splitserve serve` starts
    it; `kw` goes to that service's start function (options of the other role are dropped)."""
    if config.scheduler.role == "prefill":
        for name in ("kv_transports", "kv_tcp_streams"):
            kw.pop(name, None)
        return await start_prefill_worker(config, host, port, **kw)
    for name in ("advertise_address", "kv_data_port"):
        kw.pop(name, None)
    return await start_decode_worker(config, host, port, **kw)

HOST = "127.0.0.1"
MAX_MODEL_LEN = 2048
# 512 blocks x 16 tokens x 30 layers x 2 x 3 KV heads x 64 x 4 B ~= 377 MB per engine: enough
# for every concurrent test here, small enough for four engines on a shared machine.
NUM_BLOCKS = 512
BLOCK_SIZE = 16
# Far longer than IDLE_TIMEOUT_S: a leaked prefill lease fails `wait_idle` instead of being
# hidden by its expiry.
KV_LEASE_MS = 300_000
LOAD_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 30.0
RPC_TIMEOUT_S = 120.0
MODEL_NAME = "SmolLM2-135M-Instruct"
INTERNAL_TOKEN = "e2e-internal-token-0123456789abcdef"


def engine_config(role: Role, speculative: SpeculativeConfig | None = None,
                  lora: LoRAConfig | None = None, pooler: PoolerConfig | None = None
                  ) -> EngineConfig:
    """The default model (LoadConfig(model="") = the embedded SmolLM2 GGUF) on the CPU."""
    return EngineConfig(
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(role=role, max_model_len=MAX_MODEL_LEN, kv_lease_ms=KV_LEASE_MS),
        runner=RunnerConfig(device="cpu"), speculative=speculative or SpeculativeConfig(),
        lora=lora or LoRAConfig(), pooler=pooler or PoolerConfig())


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run` blocks the calling thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="e2e-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the loop and wait at most `timeout_s` for its result."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


async def start_ready_worker(role: Role, timeout_s: float = LOAD_TIMEOUT_S) -> WorkerHandle:
    """`start_worker` on an ephemeral loopback port, then wait (bounded) until it serves."""
    handle = await start_worker(engine_config(role), HOST, 0)
    assert handle.load_task is not None
    await asyncio.wait_for(asyncio.shield(handle.load_task), timeout_s)
    return handle


@dataclass
class Stack:
    """One running deployment: its workers by role and the gateway in front of them."""

    loop: LoopThread
    workers: dict[str, WorkerHandle]
    gateway: GatewayServer
    internal_token: str | None = None
    stopped: bool = field(default=False)

    @property
    def rest_url(self) -> str:
        return f"http://{HOST}:{self.gateway.rest_port}/v1"

    @property
    def grpc_target(self) -> str:
        return f"{HOST}:{self.gateway.grpc_port}"

    @property
    def engines(self) -> list[LLMEngine]:
        return [w.aengine.engine for w in self.workers.values() if w.aengine is not None]

    @property
    def tokenizer(self) -> Tokenizer:
        tok = self.engines[0].tokenizer
        assert tok is not None
        return tok

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> None:
        """Wait until every engine is back to baseline (all blocks free, no lease, no request),
        then run `check_integrity()` on each engine thread. Raises AssertionError on timeout."""
        wait_engines_idle(self.loop, list(self.workers.values()), timeout_s)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.loop.run(self.gateway.stop(), 60)
        for w in self.workers.values():
            self.loop.run(w.stop(1.0), 60)


def engine_busy(engine: LLMEngine) -> str | None:
    """What keeps an engine from its idle baseline, or None. Racy reads, used only for polling."""
    kv, sched = engine.kv, engine.scheduler
    if kv.num_free_blocks != kv.num_blocks:
        return f"{kv.num_blocks - kv.num_free_blocks} blocks in use"
    if sched.leases:
        return f"{len(sched.leases)} leases held"
    if sched.requests or sched.loading:
        return f"{len(sched.requests)} requests, {len(sched.loading)} loading"
    return None


def wait_engines_idle(loop: LoopThread, workers: Sequence[WorkerHandle], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {w.port: engine_busy(w.aengine.engine) for w in workers if w.aengine is not None}
        busy = {p: why for p, why in busy.items() if why is not None}
        if not busy:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not back to baseline after {timeout_s}s: {busy}")
        time.sleep(0.05)
    for w in workers:
        assert w.aengine is not None
        # The scheduler is not thread-safe: check it on the engine thread between steps.
        loop.run(w.aengine.call(w.aengine.engine.scheduler.check_integrity), 30)


async def _start_stack(loop: LoopThread, colocated: bool,
                       speculative: SpeculativeConfig | None,
                       kv_transports: Sequence[str] | None = None,
                       lora: LoRAConfig | None = None,
                       pooler: PoolerConfig | None = None,
                       gateway_options: Mapping[str, Any] | None = None) -> Stack:
    roles: list[Role] = ["colocated"] if colocated else ["prefill", "decode"]
    token = None if colocated else INTERNAL_TOKEN
    ways = {} if kv_transports is None else {"kv_transports": kv_transports}
    workers: dict[str, WorkerHandle] = {
        r: await start_worker(engine_config(r, speculative, lora, pooler), HOST, 0,
                              auth_token=token,
                              **ways)
        for r in roles}
    loads = [w.load_task for w in workers.values() if w.load_task is not None]
    await asyncio.wait_for(asyncio.gather(*loads), LOAD_TIMEOUT_S)
    engine = next(w.aengine.engine for w in workers.values() if w.aengine is not None)
    # The gateway gets the engine's tokenizer object (same file, same class) to save a reload.
    config = dataclasses.replace(_gateway_config(workers, colocated, token),
                                 **(gateway_options or {}))
    gateway = GatewayServer(config, rest_host=HOST,
                            rest_port=0, grpc_host=HOST, grpc_port=0, tokenizer=engine.tokenizer)
    return Stack(loop, workers, gateway, token)


def _gateway_config(workers: dict[str, WorkerHandle], colocated: bool,
                    internal_token: str | None) -> GatewayConfig:
    any_engine = next(w.aengine.engine for w in workers.values() if w.aengine is not None)
    decode = workers["colocated" if colocated else "decode"]
    return GatewayConfig(
        prefill_addresses=() if colocated else (f"{HOST}:{workers['prefill'].port}",),
        decode_addresses=(f"{HOST}:{decode.port}",), colocated=colocated,
        served_model_name=MODEL_NAME, tokenizer_path=any_engine.tokenizer_source or "",
        max_model_len=MAX_MODEL_LEN, max_prompt_tokens=MAX_MODEL_LEN,
        load_poll_interval_s=0.5, shutdown_grace_s=2.0, internal_token=internal_token)


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata to every call of a sync channel (the aio side: rpc/auth.py)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return _CallDetails(details.method, details.timeout,
                            [*(details.metadata or ()), *self._metadata], details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                              request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                               request: Any) -> Any:
        return continuation(self._details(client_call_details), request)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def worker_channel(stack: Stack, role: str) -> grpc.Channel:
    """A sync channel straight to one of the stack's workers, carrying its secret (if any)."""
    channel = grpc.insecure_channel(f"{HOST}:{stack.workers[role].port}")
    return grpc.intercept_channel(channel, _WithMetadata(bearer_metadata(stack.internal_token)))


def start_stack(loop: LoopThread, colocated: bool,
                speculative: SpeculativeConfig | None = None,
                kv_transports: Sequence[str] | None = None,
                lora: LoRAConfig | None = None,
                pooler: PoolerConfig | None = None,
                gateway_options: Mapping[str, Any] | None = None) -> Stack:
    """Start workers + gateway and wait (bounded) until the gateway's /health says ok.
    `speculative`: the workers' speculative decoding (the gateway then asks for it);
    `kv_transports`: the decode worker's ways to pull KV (default: all); `pooler`: the
    workers' pooling (a classifier: `classifier_from_token`); `gateway_options`: GatewayConfig
    fields that differ from the stack's defaults."""
    stack = loop.run(_start_stack(loop, colocated, speculative, kv_transports, lora, pooler,
                                  gateway_options), LOAD_TIMEOUT_S + 30)
    try:
        loop.run(stack.gateway.start(), 120)
        wait_healthy(f"http://{HOST}:{stack.gateway.rest_port}/health", 60)
    except BaseException:
        stack.stop()
        raise
    return stack


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text}"
        except httpx.HTTPError as err:
            last = repr(err)
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout_s}s: {last}")


# ---- gRPC Gateway.Generate helpers -------------------------------------------------------------

def greedy_sampling(max_tokens: int) -> common_pb2.SamplingParams:
    """Greedy, EOS ignored: every request runs exactly `max_tokens` tokens (stable to compare)."""
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class Generated:
    """What one `Gateway.Generate` call streamed."""

    token_ids: list[int]
    text: str
    num_chunks: int
    complete: gateway_pb2.GenerateComplete


def generate(target: str, prompt_ids: Sequence[int], max_tokens: int,
             timeout_s: float = RPC_TIMEOUT_S) -> Generated:
    """Greedy `Gateway.Generate` with token-id input; asserts the stream's shape."""
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=list(prompt_ids)),
            sampling=greedy_sampling(max_tokens), skip_special_tokens=True)
        responses = list(stub.Generate(request, timeout=timeout_s))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds and kinds[-1] == "complete" and set(kinds[:-1]) <= {"chunk"}, kinds
    chunks = [r.chunk for r in responses[:-1]]
    return Generated([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                     len(chunks), responses[-1].complete)


def generate_many(target: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                  concurrent: bool) -> list[Generated]:
    """All prompts one by one, or all at once (one thread per prompt)."""
    if not concurrent:
        return [generate(target, p, max_tokens) for p in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda p: generate(target, p, max_tokens), prompts))


# ---- prompts -----------------------------------------------------------------------------------

_TOPICS = ["the ocean", "a small robot", "mountains in winter", "the history of bread",
           "a lighthouse keeper", "prime numbers", "a busy train station", "honey bees",
           "an old library", "the first day of spring"]


def varied_prompts(tokenizer: Tokenizer, count: int = 12) -> list[list[int]]:
    """`count` distinct prompts: short ones (< 1 block), several blocks, and multi-hundred tokens."""
    prompts: list[list[int]] = []
    for i in range(count):
        topic = _TOPICS[i % len(_TOPICS)]
        if i % 5 == 4:  # multi-hundred tokens: a numbered list long enough for 10+ blocks
            lines = [f"{j}. A fact about {topic} number {j * (i + 3)}." for j in range(5 + 2 * i)]
            text = "Read these notes.\n" + "\n".join(lines) + "\nSummary:"
        elif i % 2:
            text = (f"Write a short story about {topic}. The story should be calm, kind and "
                    f"simple, and it should end with a surprise. Version {i}:")
        else:
            text = f"{topic.capitalize()} is"
        prompts.append(tokenizer.encode(text))
    return prompts


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def disagg_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Gateway → 1 prefill worker + 1 decode worker (KV over gRPC), shared by all e2e tests."""
    stack = start_stack(loop_thread, colocated=False)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def colocated_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Gateway (colocated=True) → 1 colocated worker: the greedy oracle."""
    stack = start_stack(loop_thread, colocated=True)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def tokenizer(colocated_stack: Stack) -> Tokenizer:
    return colocated_stack.tokenizer


@pytest.fixture(scope="session")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return varied_prompts(tokenizer)


ORACLE_MAX_TOKENS = 8


@pytest.fixture(scope="session")
def oracle(colocated_stack: Stack, prompts: list[list[int]]) -> list[Generated]:
    """Colocated greedy outputs of `prompts`, sent one by one (ORACLE_MAX_TOKENS each)."""
    return generate_many(colocated_stack.grpc_target, prompts, ORACLE_MAX_TOKENS, concurrent=False)


# ---- tool calling ------------------------------------------------------------------------------

TOOLS_TEMPLATE = (Path(__file__).resolve().parents[2] / "gateway" / "chat_templates"
                  / "chatml_hermes_tools.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
# The model writes text, then a call (a regex makes it: the parser is under test, not SmolLM2,
# which rarely calls a tool by itself).
FORCED_CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "[A-Z][a-z]{1,10}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@contextlib.contextmanager
def extra_gateway(stack: Stack, **changes: Any) -> Iterator[GatewayServer]:
    """A second gateway in front of `stack`'s workers, its config the stack's with `changes`
    (started on the stack's loop, healthy when yielded, stopped after)."""
    gateway = GatewayServer(stack.gateway.config.replace(**changes), rest_host=HOST,
                            rest_port=0, grpc_host=HOST, grpc_port=0, tokenizer=stack.tokenizer)
    stack.loop.run(gateway.start(), 120)
    try:
        wait_healthy(f"http://{HOST}:{gateway.rest_port}/health", 60)
        yield gateway
    finally:
        stack.loop.run(gateway.stop(), 60)


@pytest.fixture(scope="module")
def tools_gateway_server(disagg_stack: Stack) -> Iterator[GatewayServer]:
    """A second gateway in front of the disaggregated stack's workers, with tool calling."""
    with extra_gateway(disagg_stack, tool_call_parser="hermes",
                       chat_template=load_chat_template(str(TOOLS_TEMPLATE))) as gateway:
        yield gateway
