"""Load shedding through the gateway: a full worker's RESOURCE_EXHAUSTED makes the gateway try
the pool's other workers, then answer 429 (`Retry-After: 1`; RESOURCE_EXHAUSTED on gRPC), and
`--max-concurrent-requests` refuses requests above it before any worker is called.

End to end (slow): real SmolLM2 workers that take one request at a time (`--max-num-seqs 1
--max-queued-requests 0`) behind real gateways, the real `openai` client (max_retries=0: it
retries 429s by default) and gRPC. Against fake workers (tests/support/gateway_fakes.py, fast): a pool
of two where one is full, which a single real worker cannot show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import OpenAI  # noqa: E402
from openai.types import Completion  # noqa: E402
from openai.types.completion_choice import CompletionChoice  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine.config import EngineConfig, Role  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.server import GatewayServer  # noqa: E402
from protos.splitserve.v1 import common_pb2, prefill_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import (  # noqa: E402
    HOST,
    INTERNAL_TOKEN,
    LOAD_TIMEOUT_S,
    MAX_MODEL_LEN,
    MODEL_NAME,
    LoopThread,
    Stack,
    engine_config,
    extra_gateway,
    generate,
    start_worker,
    wait_healthy,
    worker_channel,
)
from tests.support.gateway_fakes import Harness, Script, smollm2_tokenizer  # noqa: E402
from worker.server import WorkerHandle  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
slow = pytest.mark.slow

# Long enough to outlast every check made while it runs (~10 s on 2 shared CPU cores).
LONG_MAX_TOKENS = 128
PROMPT = "Tell me a long story about a lighthouse keeper."
REFUSED = "splitserve:requests_refused_total"


# ---- stacks ------------------------------------------------------------------------------------

def _one_at_a_time(role: Role) -> EngineConfig:
    """The worker flags `--max-num-seqs 1 --max-queued-requests 0`: one request in flight."""
    config = engine_config(role)
    return dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_num_seqs=1, max_queued_requests=0))


@dataclasses.dataclass
class Stacks:
    colocated: Stack  # its one worker takes one request at a time
    disagg: Stack     # a prefill worker without a bound; the decode worker takes one at a time


async def _start_workers() -> dict[str, WorkerHandle]:
    """The three workers, loading at once (start_worker returns before its engine loads)."""
    workers = {
        "colocated": await start_worker(_one_at_a_time("colocated"), HOST, 0),
        "prefill": await start_worker(engine_config("prefill"), HOST, 0,
                                      auth_token=INTERNAL_TOKEN),
        "decode": await start_worker(_one_at_a_time("decode"), HOST, 0,
                                     auth_token=INTERNAL_TOKEN)}
    for w in workers.values():
        assert w.load_task is not None
        await w.load_task
    return workers


def _serve(loop: LoopThread, workers: dict[str, WorkerHandle], token: str | None) -> Stack:
    """A gateway in front of `workers` (a colocated one, or a prefill and a decode one)."""
    colocated = "colocated" in workers
    engine = next(w.aengine.engine for w in workers.values() if w.aengine is not None)
    config = GatewayConfig(
        prefill_addresses=() if colocated else (f"{HOST}:{workers['prefill'].port}",),
        decode_addresses=(f"{HOST}:{workers['colocated' if colocated else 'decode'].port}",),
        colocated=colocated, served_model_name=MODEL_NAME,
        tokenizer_path=engine.tokenizer_source or "", max_model_len=MAX_MODEL_LEN,
        max_prompt_tokens=MAX_MODEL_LEN, load_poll_interval_s=0.5, shutdown_grace_s=2.0,
        internal_token=token)
    gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST, grpc_port=0,
                            tokenizer=engine.tokenizer)
    loop.run(gateway.start(), 120)
    wait_healthy(f"http://{HOST}:{gateway.rest_port}/health", 60)
    return Stack(loop, workers, gateway, token)


@pytest.fixture(scope="module")
def stacks(loop_thread: LoopThread) -> Iterator[Stacks]:
    workers = loop_thread.run(_start_workers(), LOAD_TIMEOUT_S)
    started: list[Stack] = []
    try:
        started.append(_serve(loop_thread, {"colocated": workers["colocated"]}, None))
        started.append(_serve(loop_thread, {r: workers[r] for r in ("prefill", "decode")},
                              INTERNAL_TOKEN))
        yield Stacks(*started)
    finally:
        for stack in started:
            loop_thread.run(stack.gateway.stop(), 60)
        for w in workers.values():
            loop_thread.run(w.stop(1.0), 60)


@pytest.fixture(scope="module")
def limited(stacks: Stacks) -> Iterator[GatewayServer]:
    """A second gateway in front of the colocated worker, with --max-concurrent-requests 1."""
    with extra_gateway(stacks.colocated, max_concurrent_requests=1) as gateway:
        yield gateway


# ---- helpers -----------------------------------------------------------------------------------

def _client(gateway: GatewayServer) -> OpenAI:
    return OpenAI(base_url=f"http://{HOST}:{gateway.rest_port}/v1", api_key="unused",
                  max_retries=0)


@contextlib.contextmanager
def _long_stream(client: OpenAI) -> Iterator[Iterator[Completion]]:
    """A streamed greedy completion that ignores EOS, running: its decode worker streamed
    tokens (the first chunk of a disaggregated stream is the prefill worker's), so it holds
    that worker's one seat, and its place at the gateway. Yields the chunks still to come;
    leaving the block closes the stream (a client that hangs up, if it was not over)."""
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True,
                                       max_tokens=LONG_MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    try:
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        yield chunks
    finally:
        stream.close()


def _refused(err: openai.RateLimitError, *words: str) -> None:
    """A 429 with OpenAI's error body, `Retry-After: 1` and `words` in its message."""
    assert err.status_code == 429
    assert err.response.headers.get("retry-after") == "1", dict(err.response.headers)
    body = err.response.json()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == 429, body
    for w in words:
        assert w in body["message"], (w, body["message"])


def _grpc_refused(stack_target: str, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stack_target, smollm2_tokenizer().encode("Hello there"), 4)
    err: grpc.Call = info.value  # type: ignore[assignment]
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    for w in words:
        assert w in (err.details() or ""), (w, err.details())


def _short(client: OpenAI) -> CompletionChoice:
    r = client.completions.create(model=MODEL_NAME, prompt="The sea is", max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    return r.choices[0]


def _refusals(gateway: GatewayServer) -> dict[str, float]:
    """The gateway's refused-requests counter by reason, from its /metrics."""
    text = httpx.get(f"http://{HOST}:{gateway.rest_port}/metrics", timeout=10).text
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == REFUSED}


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s}s: {what}")
        time.sleep(0.05)


def _balanced(gateway: GatewayServer) -> None:
    """Every pick the router made for a call was matched by its `done`."""
    assert gateway.state is not None
    router = gateway.state.router
    pools = [p for p in (router.prefill, router.decode) if p is not None]
    assert all(w.in_flight == 0 for p in pools for w in p.workers), [
        (w.address, w.in_flight) for p in pools for w in p.workers]


def _num_leases(stack: Stack) -> int:
    stub = prefill_pb2_grpc.PrefillStub(worker_channel(stack, "prefill"))
    return stub.GetLoad(common_pb2.LoadRequest(), timeout=10).num_leases


# ---- end to end: full workers ------------------------------------------------------------------

@slow
def test_a_full_worker_is_a_429_until_it_has_room(stacks: Stacks) -> None:
    stack = stacks.colocated
    stack.wait_idle()
    client = _client(stack.gateway)
    before = _refusals(stack.gateway).get("workers_overloaded", 0.0)
    with _long_stream(client) as long:
        with pytest.raises(openai.RateLimitError) as info:
            _short(client)
        _refused(info.value, "overloaded: every decode worker is full", "retry later")
        # Chat, streamed: refused before its stream began: a real status, not an in-band error.
        with pytest.raises(openai.RateLimitError) as chat:
            list(client.chat.completions.create(model=MODEL_NAME, max_tokens=4, stream=True,
                                                messages=[{"role": "user", "content": "Hi"}]))
        _refused(chat.value, "overloaded")
        _grpc_refused(stack.grpc_target, "overloaded")
        # The refusals did not disturb the running request, which runs to its end.
        chunks = list(long)
    assert len(chunks) > 1, "the long request ended before the checks: raise LONG_MAX_TOKENS"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert _short(client).finish_reason == "length"  # room again
    assert _refusals(stack.gateway)["workers_overloaded"] == before + 3
    _balanced(stack.gateway)
    stack.wait_idle()


@slow
def test_a_full_decode_worker_is_a_429_and_the_prefill_lease_is_released(
        stacks: Stacks) -> None:
    stack = stacks.disagg
    stack.wait_idle()
    client = _client(stack.gateway)
    prefill = stack.workers["prefill"].aengine
    assert prefill is not None
    with _long_stream(client):  # holds the decode worker's one seat
        steps = prefill.engine.num_steps
        with pytest.raises(openai.RateLimitError) as info:
            _short(client)
        _refused(info.value, "overloaded: every decode worker is full")
        # Its prefill ran (and leased its KV for a decode worker that refused it): the lease
        # is released now, not when it expires (KV_LEASE_MS is minutes).
        assert prefill.engine.num_steps > steps
        _wait_for(lambda: _num_leases(stack) == 0, "the refused request's lease released")
    stack.wait_idle()
    _balanced(stack.gateway)
    assert _short(client).finish_reason == "length"
    stack.wait_idle()


# ---- end to end: the gateway's bound -----------------------------------------------------------

@slow
def test_the_gateway_bound_refuses_before_any_worker(stacks: Stacks,
                                                     limited: GatewayServer) -> None:
    stack = stacks.colocated
    stack.wait_idle()
    assert limited.state is not None
    limit = limited.state.limit
    client = _client(limited)
    before = _refusals(limited)
    with _long_stream(client) as long:
        assert limit.num_in_flight == 1
        with pytest.raises(openai.RateLimitError) as info:
            _short(client)
        # The gateway's own refusal: the full worker's says "max_num_seqs".
        _refused(info.value, "this gateway", "--max-concurrent-requests")
        with pytest.raises(openai.RateLimitError) as emb:
            client.embeddings.create(model=MODEL_NAME, input="the sea")
        _refused(emb.value, "--max-concurrent-requests")
        _grpc_refused(f"{HOST}:{limited.grpc_port}", "--max-concurrent-requests")
        next(long)  # still streaming; leaving the block hangs up mid-stream
    _wait_for(lambda: limit.num_in_flight == 0, "the disconnected stream's place given back")
    stack.wait_idle()  # and the worker's seat
    assert _short(client).finish_reason == "length"
    assert limit.num_in_flight == 0
    after = _refusals(limited)
    assert after["gateway_limit"] == before.get("gateway_limit", 0.0) + 3
    assert after.get("workers_overloaded", 0.0) == before.get("workers_overloaded", 0.0)
    _balanced(limited)


# ---- fake workers: a pool of two, one full -----------------------------------------------------

FULL = grpc.StatusCode.RESOURCE_EXHAUSTED


def _full(script: Script, prefill: bool) -> Script:
    return dataclasses.replace(script, **{"prefill_error" if prefill else "decode_error": FULL})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_full_worker_sends_the_call_to_the_other(role: str) -> None:
    ids = smollm2_tokenizer().encode(" the sea is calm today", add_special_tokens=False)
    h = Harness(Script(ids), num_prefill=2 if role == "prefill" else 1, num_decode=2)
    pool = h.prefill if role == "prefill" else h.decode
    pool[0].script = _full(h.script, role == "prefill")
    pool[1].num_running = 3  # the full one looks idle: the router tries it first
    with h:
        client = OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4)
        assert r.choices[0].finish_reason == "length"
        calls = [w.prefill_requests if role == "prefill" else w.decode_requests for w in pool]
        assert [len(c) for c in calls] == [1, 1]
        assert h.gateway is not None and h.gateway.state is not None
        router = h.gateway.state.router
        workers = (router.prefill if role == "prefill" else router.decode).workers  # type: ignore[union-attr]
        assert all(w.healthy for w in workers)  # full is not down: still routed to
        _balanced(h.gateway)
        if role == "decode":
            # A full decode worker refuses before pulling and leaves the lease: the other one
            # gets the same handle and pulls the prompt's KV instead of computing it.
            first, second = h.decode[0].decode_requests[0], h.decode[1].decode_requests[0]
            assert first.HasField("kv_handle") and second.HasField("kv_handle")
            assert second.kv_handle == first.kv_handle
            rid = h.prefill[0].prefill_requests[-1].request_id
            assert rid not in h.prefill[0].released  # the pull's to take, not the gateway's


def test_every_worker_full_is_a_429_with_the_lease_released() -> None:
    ids = smollm2_tokenizer().encode(" the sea is calm today", add_special_tokens=False)
    with Harness(Script(ids), num_decode=2) as h:
        for w in h.decode:
            w.script = _full(h.script, prefill=False)
        r = httpx.post(h.base_url + "/v1/completions", timeout=20,
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "overloaded" in err["message"]
        assert "every decode worker is full (2 refused" in err["message"]
        assert [len(w.decode_requests) for w in h.decode] == [1, 1]  # each tried once
        rid = h.prefill[0].prefill_requests[-1].request_id
        _wait_for(lambda: rid in h.prefill[0].released, "the lease released", 10)
        assert h.gateway is not None
        _balanced(h.gateway)
        assert _refusals(h.gateway) == {"workers_overloaded": 1.0}
