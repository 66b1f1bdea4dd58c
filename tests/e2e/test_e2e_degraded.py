"""Degraded, never down, with real worker processes (bench/process_stack.py) behind a real
gateway, in order: SIGSTOP the decode worker mid-stream and new requests go whole to the
prefill worker meanwhile, the stopped streams finishing after SIGCONT; SIGKILL the only decode
worker mid-stream and the streams finish on the prefill worker; bring it back and the gateway
serves disaggregated again; SIGKILL the only prefill worker and in-flight and new requests
finish on the decode worker. Every stream has exactly the greedy tokens of a reference run, and
the survivors end idle (no request, no lease, no KV block held). One module-scoped stack (three
worker starts); the workers run a tiny random model (`dummy:tiny`, the same weights in every
process): what is under test is where tokens come from, not what they say."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from bench.process_stack import ServiceProcess, spawn_worker, wait_idle, wait_serving
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.e2e_stack import HOST, MODEL_NAME, LoopThread, greedy_sampling
from tests.support.gateway_fakes import smollm2_tokenizer
from tests.support.prom import sample_value

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

MAX_TOKENS = 200  # long enough that every stream is mid-way when its worker is killed
PROMPTS = [[(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 20, 40))]
WORKER_ARGS = ("--model", "dummy:tiny", "--dtype", "float32")
IDLE_S = 20.0  # the workers' lease time (WORKER_ENGINE_ARGS: 20 s) bounds any leftover


@dataclass
class Degraded:
    loop: LoopThread
    gateway: GatewayServer
    prefill: ServiceProcess
    decode: ServiceProcess
    reference: list[list[int]] = field(default_factory=list)

    @property
    def health(self) -> dict[str, str]:
        out: dict[str, str] = httpx.get(f"http://{HOST}:{self.gateway.rest_port}/health",
                                        timeout=10).json()
        return out

    def wait_mode(self, mode: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health["serving_mode"] != mode:
            assert time.monotonic() < deadline, f"mode {mode} not reached: {self.health}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def degraded(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Degraded]:
    logs = tmp_path_factory.mktemp("degraded-logs")
    prefill, decode = (spawn_worker(role, logs, extra_args=WORKER_ARGS)
                       for role in ("prefill", "decode"))
    try:
        wait_serving(prefill)
        wait_serving(decode)
        config = GatewayConfig(prefill_addresses=(prefill.address,),
                               decode_addresses=(decode.address,), served_model_name=MODEL_NAME,
                               max_model_len=1024, max_prompt_tokens=1024,
                               load_poll_interval_s=0.3, load_poll_timeout_s=2.0,
                               shutdown_grace_s=1.0)
        gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST,
                                grpc_port=0, tokenizer=smollm2_tokenizer())
        loop_thread.run(gateway.start(), 60)
        try:
            yield Degraded(loop_thread, gateway, prefill, decode)
        finally:
            loop_thread.run(gateway.stop(), 60)
    finally:
        for w in (prefill, decode):
            w.stop()


def _stream(target: str, prompt: Sequence[int], first: threading.Event) -> list[int]:
    """A greedy Gateway.Generate stream's token ids; sets `first` at its first chunk."""
    ids: list[int] = []
    with grpc.insecure_channel(target) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=list(prompt)),
            sampling=greedy_sampling(MAX_TOKENS)), timeout=300)
        for response in call:
            assert response.WhichOneof("response") in ("chunk", "complete"), response
            ids.extend(response.chunk.token_ids)
            first.set()
    assert len(ids) == MAX_TOKENS
    return ids


def _streams_through(d: Degraded, fault: Callable[[], None], mid_stream: bool = True
                     ) -> list[list[int]]:
    """All prompts streamed at once; `fault()` runs once every stream has a first token
    (`mid_stream`), or as soon as they are sent (some still in prefill)."""
    target = f"{HOST}:{d.gateway.grpc_port}"
    firsts = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures: list[Future[list[int]]] = [pool.submit(_stream, target, p, e)
                                            for p, e in zip(PROMPTS, firsts, strict=True)]
        for e in firsts if mid_stream else ():
            assert e.wait(120), "a stream never started"
        fault()
        return [f.result(300) for f in futures]


def test_stopped_decode_worker_streams_resume_where_they_were(degraded: Degraded) -> None:
    """SIGSTOP the decode worker mid-stream: its streams are abandoned (no token, then no
    health answer) and resumed on the prefill worker while it is still stopped, with the
    reference tokens; new requests go whole to the prefill worker meanwhile; after SIGCONT the
    gateway serves disaggregated again and the woken worker frees what it held."""
    d = degraded
    d.wait_mode("disaggregated")
    d.reference = _streams_through(d, lambda: None)
    during: list[list[int]] = []
    stalls = _metric(d, "splitserve:decode_stalls_total")

    def stop_then_serve_around_it() -> None:
        d.decode.signal(signal.SIGSTOP)
        try:
            d.wait_mode("prefill_only", 30)
            during.append(_stream(f"{HOST}:{d.gateway.grpc_port}", PROMPTS[0],
                                  threading.Event()))
            deadline = time.monotonic() + 30  # stall (2 s) + liveness (5 s), on a busy host
            while _metric(d, "splitserve:decode_stalls_total") - stalls < len(PROMPTS):
                assert time.monotonic() < deadline, "the stopped streams were not abandoned"
                time.sleep(0.2)
        finally:
            d.decode.signal(signal.SIGCONT)

    outs = _streams_through(d, stop_then_serve_around_it)
    assert outs == d.reference and during == d.reference[:1]
    d.wait_mode("disaggregated")
    assert wait_idle([d.prefill, d.decode], IDLE_S) is not None, "a worker kept work or KV"


def test_stream_cut_by_the_only_decode_worker_finishes_on_prefill(degraded: Degraded) -> None:
    d = degraded
    assert d.reference, "runs after the reference run"
    resumes = _metric(d, "splitserve:decode_resumes_total")
    outs = _streams_through(d, lambda: d.decode.signal(signal.SIGKILL))
    assert outs == d.reference  # no token lost, doubled or different
    assert _metric(d, "splitserve:decode_resumes_total") - resumes == len(PROMPTS)
    assert d.health["serving_mode"] == "prefill_only"
    assert wait_idle([d.prefill], IDLE_S) is not None, "the prefill worker kept work or KV"


def test_back_to_disaggregated_then_the_only_prefill_worker_dies(degraded: Degraded) -> None:
    d = degraded
    assert d.reference, "runs after the reference run"
    d.decode.start()  # the same port: the gateway's pool finds it again
    wait_serving(d.decode)
    d.wait_mode("disaggregated")
    outs = _streams_through(d, lambda: d.prefill.signal(signal.SIGKILL), mid_stream=False)
    assert outs == d.reference
    d.wait_mode("decode_only")
    # New requests go whole to the decode worker.
    assert _streams_through(d, lambda: None) == d.reference
    assert _metric(d, "splitserve:serving_mode", mode="decode_only") == 1.0
    assert wait_idle([d.decode], IDLE_S) is not None, "the decode worker kept work or KV"


def _metric(d: Degraded, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics, by name and a subset of its labels."""
    return sample_value(httpx.get(f"http://{HOST}:{d.gateway.rest_port}/metrics", timeout=10
                                  ).text, name, **labels)

