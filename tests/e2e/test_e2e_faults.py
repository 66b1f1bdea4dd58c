"""Faults end to end: client disconnects free KV on both services; bad input is a 4xx /
INVALID_ARGUMENT naming the problem (never a 500, never a hang); a dead prefill worker, a
released lease or a foreign fingerprint never lets decode use missing KV (recompute or fail)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain


from gateway.config import GatewayConfig  # noqa: E402
from gateway.server import GatewayServer  # noqa: E402
from kv_transfer.peers import KvPeers  # noqa: E402
from kv_transfer.protocol import MAX_FRAGMENT_BYTES, channel_options  # noqa: E402
from protos.splitserve.v1 import (  # noqa: E402
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from rpc.auth import bearer_metadata  # noqa: E402
from tests.support.e2e_stack import (  # noqa: E402
    BLOCK_SIZE,
    HOST,
    IDLE_TIMEOUT_S,
    INTERNAL_TOKEN,
    MAX_MODEL_LEN,
    MODEL_NAME,
    ORACLE_MAX_TOKENS,
    Generated,
    LoopThread,
    Stack,
    generate,
    greedy_sampling,
    start_ready_worker,
    worker_channel,
)
from worker.decode_servicer import DecodeServicer  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

HTTP_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
RPC_TIMEOUT_S = 120.0
LONG_MAX_TOKENS = 1000  # far more than a cancelled request may run
RECOMPUTE = decode_pb2.KV_FAILURE_POLICY_RECOMPUTE
FAIL = decode_pb2.KV_FAILURE_POLICY_FAIL
# What the test's own proxies send to the disaggregated stack's workers.
UPSTREAM_AUTH = bearer_metadata(INTERNAL_TOKEN)


def _decode_steps(stack: Stack) -> int:
    return sum(e.num_steps for e in stack.engines)


# ---- client disconnects ------------------------------------------------------------------------

def test_rest_stream_disconnect_frees_kv(disagg_stack: Stack) -> None:
    disagg_stack.wait_idle()
    steps = _decode_steps(disagg_stack)
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story about a dragon.",
            "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(timeout=HTTP_TIMEOUT) as client, client.stream(
            "POST", f"{disagg_stack.rest_url}/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 4:
                break  # leaving the block closes the connection mid-stream
    assert "[DONE]" not in events[-1]
    disagg_stack.wait_idle()
    # Cancellation reached the decode engine: it stopped long before max_tokens.
    assert _decode_steps(disagg_stack) - steps < LONG_MAX_TOKENS // 2


def test_rest_non_stream_disconnect_frees_kv(disagg_stack: Stack) -> None:
    disagg_stack.wait_idle()
    steps = _decode_steps(disagg_stack)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": LONG_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
        httpx.post(f"{disagg_stack.rest_url}/chat/completions", json=body,
                   timeout=httpx.Timeout(3.0, connect=5.0))
    disagg_stack.wait_idle()
    assert _decode_steps(disagg_stack) - steps < LONG_MAX_TOKENS // 2



def _aborted(stack: Stack) -> float:
    text = httpx.get(f"http://{HOST}:{stack.gateway.rest_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve:requests_aborted_total{"))


def test_stream_disconnect_during_prefill_cancels_it(disagg_stack: Stack) -> None:
    """A streaming client that leaves while its long prompt is computed is noticed within a
    second, before any first token: the prefill is cancelled, no decode runs for nobody, and
    the abort is counted."""
    disagg_stack.wait_idle()
    decode = disagg_stack.workers["decode"].aengine
    assert decode is not None
    decode_steps, aborted = decode.engine.num_steps, _aborted(disagg_stack)
    # Long enough to take a second or more on the CPU (one step: its abort lands after it).
    prompt = disagg_stack.tokenizer.encode("The sea. " * 400, add_special_tokens=False)[:800]
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 64,
                       "temperature": 0, "stream": True}).encode()
    with socket.create_connection((HOST, disagg_stack.gateway.rest_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.2)  # the body read, the prompt being computed
    left = time.monotonic()
    _wait_until(lambda: _aborted(disagg_stack) == aborted + 1, "the disconnect to be noticed",
                5.0)
    assert time.monotonic() - left < 1.5
    disagg_stack.wait_idle(90.0)  # the step computing the prompt ends first (a shared CPU)
    assert decode.engine.num_steps == decode_steps  # nothing decoded for nobody


def test_grpc_cancel_mid_stream_frees_kv(disagg_stack: Stack) -> None:
    disagg_stack.wait_idle()
    steps = _decode_steps(disagg_stack)
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateRequest(text="Once upon a time",
                                        sampling=greedy_sampling(LONG_MAX_TOKENS)),
            timeout=RPC_TIMEOUT_S)
        for chunks, response in enumerate(call, start=1):
            assert response.WhichOneof("response") == "chunk"
            if chunks == 3:
                call.cancel()
                break
    disagg_stack.wait_idle()
    assert _decode_steps(disagg_stack) - steps < LONG_MAX_TOKENS // 2


# ---- bad REST input ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(disagg_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=disagg_stack.rest_url, timeout=HTTP_TIMEOUT) as client:
        yield client


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4} | fields


def _error(resp: httpx.Response, status: int) -> str:
    """Assert an OpenAI-shaped error with `status`; returns its message."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return str(error["message"])


HEADERS = {"content-type": "application/json"}


@pytest.mark.parametrize(("path", "raw", "needle"), [
    ("/chat/completions", b'{"model": "x", "messages": [', "JSON"),
    ("/completions", b"not json at all", "JSON"),
    ("/completions", b"", "empty"),
    ("/completions", b"[1, 2, 3]", "object"),
    ("/chat/completions", b'{"model": "' + MODEL_NAME.encode() + b'", "messages": '
                          b'[{"role": "user", "content": "caf\xe9"}]}', "UTF-8"),
])
def test_malformed_bodies_are_400(http: httpx.Client, path: str, raw: bytes, needle: str) -> None:
    assert needle in _error(http.post(path, content=raw, headers=HEADERS), 400)


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/chat/completions", _chat(max_tokens="ten"), "max_tokens"),
    ("/chat/completions", _chat(max_tokens=-5), "max_tokens"),
    ("/chat/completions", _chat(max_tokens=0), "max_tokens"),
    ("/chat/completions", _chat(temperature="hot"), "temperature"),
    ("/chat/completions", _chat(temperature=-1), "temperature"),
    ("/chat/completions", _chat(messages="hello"), "messages"),
    ("/chat/completions", _chat(messages=[]), "messages"),
    ("/chat/completions", _chat(messages=[{"role": "user", "content": "\ud800"}]), "UTF-8"),
    ("/chat/completions", _chat(n=1000), "n"),
    ("/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/completions", {"model": MODEL_NAME, "prompt": 12}, "prompt"),
    ("/completions", {"model": MODEL_NAME, "prompt": [1, -2]}, "prompt"),
    ("/completions", {"model": MODEL_NAME, "prompt": [1, 10_000_000]}, "prompt"),
    ("/completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 7}, "top_p"),
])
def test_wrong_fields_are_400(http: httpx.Client, path: str, body: dict[str, object],
                              needle: str) -> None:
    raw = json.dumps(body).encode()  # json.dumps escapes the lone surrogate as \ud800
    assert needle in _error(http.post(path, content=raw, headers=HEADERS), 400)


def test_unknown_model_is_404_naming_it(http: httpx.Client) -> None:
    resp = http.post("/chat/completions", json=_chat(model="gpt-17"))
    assert "gpt-17" in _error(resp, 404)
    assert resp.json()["error"]["param"] == "model"


def test_prompt_longer_than_context_is_400(http: httpx.Client) -> None:
    resp = http.post("/completions", json={"model": MODEL_NAME, "prompt": "hello " * MAX_MODEL_LEN,
                                           "max_tokens": 4})
    message = _error(resp, 400)
    assert "prompt" in message and str(MAX_MODEL_LEN) in message
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_past_context_is_400(http: httpx.Client) -> None:
    message = _error(http.post("/completions", json={
        "model": MODEL_NAME, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}), 400)
    assert "max_tokens" in message and str(MAX_MODEL_LEN) in message


def test_oversized_body_is_413(http: httpx.Client) -> None:
    raw = json.dumps(_chat(messages=[{"role": "user", "content": "x" * (5 << 20)}])).encode()
    message = _error(http.post("/chat/completions", content=raw, headers=HEADERS), 413)
    assert "limit" in message


def test_bad_input_leaves_the_stack_idle_and_serving(disagg_stack: Stack,
                                                     http: httpx.Client) -> None:
    disagg_stack.wait_idle()
    resp = http.post("/completions", json={"model": MODEL_NAME, "prompt": "The sky is",
                                           "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


# ---- bad input straight to the workers -----------------------------------------------------------

def _worker_channel(stack: Stack, role: str) -> grpc.Channel:
    return worker_channel(stack, role)


def test_worker_rejects_bad_prefill_and_decode(disagg_stack: Stack) -> None:
    with _worker_channel(disagg_stack, "prefill") as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        for request, needle in [
            (prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[]), "prompt"),
            (prefill_pb2.PrefillRequest(request_id="", prompt_token_ids=[1]), "request_id"),
            (prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1] * MAX_MODEL_LEN),
             "max_model_len"),
            (prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[10_000_000]), "prompt"),
            (prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=(
                common_pb2.SamplingParams(logit_bias={10_000_000: 1.0}))), "logit_bias"),
            (prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=(
                common_pb2.SamplingParams(logit_bias={5: -1e9}))), "logit_bias"),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Prefill(request, timeout=RPC_TIMEOUT_S)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert needle in str(info.value.details())  # type: ignore[attr-defined]
    with _worker_channel(disagg_stack, "decode") as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(
                request_id="d", prompt_token_ids=[1, 2], output_token_ids=[3, 4, 5],
                sampling=greedy_sampling(2)), timeout=RPC_TIMEOUT_S))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "max_tokens" in str(info.value.details())  # type: ignore[attr-defined]
    disagg_stack.wait_idle()


# ---- KV failures between Prefill and Decode ------------------------------------------------------

@dataclass
class DecodeResult:
    token_ids: list[int]            # first token (from prefill) + decoded tokens
    complete: decode_pb2.DecodeComplete


def _prefill(channel: grpc.Channel, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    resp: prefill_pb2.PrefillResponse = prefill_pb2_grpc.PrefillStub(channel).Prefill(
        prefill_pb2.PrefillRequest(request_id=f"p-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                                   sampling=greedy_sampling(ORACLE_MAX_TOKENS)),
        timeout=RPC_TIMEOUT_S)
    assert resp.HasField("kv_handle") and resp.kv_handle.num_tokens == len(prompt)
    return resp


def _decode(stack: Stack, prompt: list[int], prefill: prefill_pb2.PrefillResponse,
            policy: int, handle: object | None = None) -> DecodeResult:
    request = decode_pb2.DecodeRequest(
        request_id=f"d-{uuid.uuid4().hex}", prompt_token_ids=prompt,
        output_token_ids=[prefill.first_token_id], sampling=greedy_sampling(ORACLE_MAX_TOKENS),
        kv_failure_policy=policy)  # type: ignore[arg-type]
    request.kv_handle.CopyFrom(handle or prefill.kv_handle)  # type: ignore[arg-type]
    with _worker_channel(stack, "decode") as ch:
        responses = list(decode_pb2_grpc.DecodeStub(ch).Decode(request, timeout=RPC_TIMEOUT_S))
    assert responses[-1].WhichOneof("response") == "complete"
    ids = [prefill.first_token_id] + [t for r in responses[:-1] for t in r.chunk.token_ids]
    return DecodeResult(ids, responses[-1].complete)


def _long_prompt(prompts: list[list[int]]) -> tuple[int, list[int]]:
    """The index and ids of a prompt several blocks long (so a transfer has many blocks)."""
    index = max(range(len(prompts)), key=lambda i: len(prompts[i]) if len(prompts[i]) < 300 else 0)
    return index, prompts[index]


@dataclass
class DeadPrefill:
    """Two prefills done on a worker that was then stopped (their leases died with it)."""

    prompt_index: int
    prompt: list[int]
    for_recompute: prefill_pb2.PrefillResponse
    for_fail: prefill_pb2.PrefillResponse


@pytest.fixture(scope="module")
def dead_prefill(loop_thread: LoopThread, prompts: list[list[int]]) -> DeadPrefill:
    index, prompt = _long_prompt(prompts)

    async def prefill_then_kill() -> DeadPrefill:
        handle = await start_ready_worker("prefill")
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{handle.port}") as ch:
                stub = prefill_pb2_grpc.PrefillStub(ch)
                resps = [await stub.Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"dead-{i}", prompt_token_ids=prompt,
                    sampling=greedy_sampling(ORACLE_MAX_TOKENS)), timeout=RPC_TIMEOUT_S)
                    for i in range(2)]
        finally:
            await handle.stop(0)
        return DeadPrefill(index, prompt, resps[0], resps[1])

    return loop_thread.run(prefill_then_kill(), 400)


def test_dead_prefill_worker_recompute(disagg_stack: Stack, dead_prefill: DeadPrefill,
                                       oracle: list[Generated]) -> None:
    resp = dead_prefill.for_recompute
    assert resp.kv_handle.num_blocks > 1
    out = _decode(disagg_stack, dead_prefill.prompt, resp, RECOMPUTE)
    assert out.complete.kv_recomputed
    assert out.token_ids == oracle[dead_prefill.prompt_index].token_ids
    assert out.complete.num_output_tokens == ORACLE_MAX_TOKENS
    disagg_stack.wait_idle()


def test_dead_prefill_worker_fail_is_unavailable(disagg_stack: Stack,
                                                 dead_prefill: DeadPrefill) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _decode(disagg_stack, dead_prefill.prompt, dead_prefill.for_fail, FAIL)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    disagg_stack.wait_idle()


def test_released_lease_recompute_or_fail(disagg_stack: Stack, prompts: list[list[int]],
                                          oracle: list[Generated]) -> None:
    """The worker is alive but the lease is gone (released / expired): never decode from it."""
    index, prompt = _long_prompt(prompts)
    with _worker_channel(disagg_stack, "prefill") as ch:
        kv = kv_transfer_pb2_grpc.KvTransferStub(ch)
        first, second = _prefill(ch, prompt), _prefill(ch, prompt)
        for resp in (first, second):
            assert kv.Release(kv_transfer_pb2.ReleaseRequest(
                request_id=resp.kv_handle.request_id), timeout=RPC_TIMEOUT_S).released
    out = _decode(disagg_stack, prompt, first, RECOMPUTE)
    assert out.complete.kv_recomputed
    assert out.token_ids == oracle[index].token_ids
    with pytest.raises(grpc.RpcError) as info:
        _decode(disagg_stack, prompt, second, FAIL)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    disagg_stack.wait_idle()


def test_live_lease_transfers_without_recompute(disagg_stack: Stack, prompts: list[list[int]],
                                                oracle: list[Generated]) -> None:
    """The control case of the tests above: a good handle is pulled, not recomputed."""
    index, prompt = _long_prompt(prompts)
    with _worker_channel(disagg_stack, "prefill") as ch:
        resp = _prefill(ch, prompt)
    out = _decode(disagg_stack, prompt, resp, FAIL)
    assert not out.complete.kv_recomputed
    assert out.token_ids == oracle[index].token_ids
    disagg_stack.wait_idle()  # decode acknowledged: the prefill lease is gone


def test_wrong_fingerprint_recompute_or_invalid(disagg_stack: Stack, prompts: list[list[int]],
                                                oracle: list[Generated]) -> None:
    index, prompt = _long_prompt(prompts)
    with _worker_channel(disagg_stack, "prefill") as ch:
        resp = _prefill(ch, prompt)
        forged = prefill_pb2.PrefillResponse()
        forged.CopyFrom(resp)
        forged.kv_handle.fingerprint = bytes(len(resp.kv_handle.fingerprint) or 16)
        out = _decode(disagg_stack, prompt, resp, RECOMPUTE, handle=forged.kv_handle)
        assert out.complete.kv_recomputed
        assert out.token_ids == oracle[index].token_ids
        with pytest.raises(grpc.RpcError) as info:
            _decode(disagg_stack, prompt, resp, FAIL, handle=forged.kv_handle)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "fingerprint" in str(info.value.details())  # type: ignore[attr-defined]
        # Decode never pulled this lease, so nobody acknowledged it: drop it (expiry would too).
        kv_transfer_pb2_grpc.KvTransferStub(ch).Release(
            kv_transfer_pb2.ReleaseRequest(request_id=resp.kv_handle.request_id),
            timeout=RPC_TIMEOUT_S)
    disagg_stack.wait_idle()


# ---- cancellation races around the lease ---------------------------------------------------------

def _fresh_prompt(seed: int, length: int) -> list[int]:
    """Token ids no other test uses (no prefix-cache hit), so computing them takes a while."""
    return [1000 + (seed * 7919 + i * 104_729) % 40_000 for i in range(length)]


def _wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)


def test_decode_cancelled_before_its_pull_releases_the_prefill_lease(disagg_stack: Stack) -> None:
    """A Decode cancelled while it waits for the engine (the pull never began) must release the
    prefill worker's lease: otherwise the blocks stay held until the lease expires."""
    disagg_stack.wait_idle()
    decode = disagg_stack.workers["decode"].aengine
    assert decode is not None
    with _worker_channel(disagg_stack, "prefill") as ch:
        prefill = _prefill(ch, _fresh_prompt(1, 40))
    with _worker_channel(disagg_stack, "decode") as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        # Keep the decode engine inside one long step (a fresh 800-token prompt, no KV handle).
        busy = stub.Decode(decode_pb2.DecodeRequest(
            request_id="busy", prompt_token_ids=_fresh_prompt(2, 800),
            sampling=greedy_sampling(1)), timeout=RPC_TIMEOUT_S)
        _wait_until(lambda: bool(decode.engine.scheduler.running), "the busy step")
        rid = f"d-{uuid.uuid4().hex}"
        request = decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=_fresh_prompt(1, 40),
            output_token_ids=[prefill.first_token_id], sampling=greedy_sampling(4),
            kv_handle=prefill.kv_handle, kv_failure_policy=RECOMPUTE)
        waiting = stub.Decode(request, timeout=RPC_TIMEOUT_S)
        # The handler has queued the request (private read: the engine has not seen it yet).
        _wait_until(lambda: rid in decode._queues, "the decode handler")
        waiting.cancel()
        assert [r.WhichOneof("response") for r in busy][-1] == "complete"
    disagg_stack.wait_idle()


def test_prefill_cancelled_at_any_point_leaves_no_lease(disagg_stack: Stack) -> None:
    disagg_stack.wait_idle()
    with _worker_channel(disagg_stack, "prefill") as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        kv = kv_transfer_pb2_grpc.KvTransferStub(ch)
        for n, deadline_s in enumerate([0.05, 0.2, 0.5, 1.0, 2.0]):
            request = prefill_pb2.PrefillRequest(
                request_id=f"cancel-{n}-{uuid.uuid4().hex}",
                prompt_token_ids=_fresh_prompt(10 + n, 500), sampling=greedy_sampling(4))
            try:
                resp = stub.Prefill(request, timeout=deadline_s)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err  # type: ignore[attr-defined]
                continue
            # Finished in time: this lease is legitimately ours to drop.
            kv.Release(kv_transfer_pb2.ReleaseRequest(request_id=resp.kv_handle.request_id),
                       timeout=RPC_TIMEOUT_S)
    disagg_stack.wait_idle()


# ---- requests that end at the first token (decode never pulls the lease) ----------------------

@pytest.mark.parametrize("fields", [
    {"max_tokens": 1},                                        # length at the first token
    {"max_tokens": 8, "stop": [" Paris", "Paris"]},           # stop string in the first token
])
def test_finish_at_first_token_leaves_no_lease(disagg_stack: Stack, http: httpx.Client,
                                               fields: dict[str, object]) -> None:
    disagg_stack.wait_idle()
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "temperature": 0} | fields
    resp = http.post("/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == ("length" if fields["max_tokens"] == 1 else "stop")
    assert resp.json()["usage"]["completion_tokens"] == 1
    disagg_stack.wait_idle()


# ---- KV that is partial, corrupt or not the prompt's: never used as data ----------------------

class _FaultyKvProxy(kv_transfer_pb2_grpc.KvTransferServicer):
    """A KvTransfer peer in front of the real prefill worker that damages what it forwards:
    "truncate" ends the stream after block 0 (the prefill worker died mid-transfer), "corrupt"
    flips one payload byte of block 1 (checksum). Release is forwarded as is."""

    def __init__(self, upstream: str, mode: str) -> None:
        self.upstream = upstream
        self.mode = mode

    async def PullBlocks(self, request, context):  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(self.upstream, options=channel_options(
                MAX_FRAGMENT_BYTES)) as channel:
            async for frag in kv_transfer_pb2_grpc.KvTransferStub(channel).PullBlocks(
                    request, metadata=UPSTREAM_AUTH):
                if self.mode == "truncate" and frag.block_index >= 1:
                    return
                if self.mode == "corrupt" and frag.block_index == 1 and frag.offset == 0:
                    data = bytearray(frag.data)
                    data[len(data) // 2] ^= 0xFF
                    frag.data = bytes(data)
                yield frag

    async def Release(self, request, context):  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(self.upstream) as channel:
            return await kv_transfer_pb2_grpc.KvTransferStub(channel).Release(
                request, metadata=UPSTREAM_AUTH)


@pytest.fixture(scope="module")
def faulty_proxies(loop_thread: LoopThread, disagg_stack: Stack) -> Iterator[dict[str, str]]:
    """mode -> address of a `_FaultyKvProxy` for the disaggregated stack's prefill worker."""
    upstream = f"{HOST}:{disagg_stack.workers['prefill'].port}"

    async def start() -> None:
        ports = {}
        for mode in ("truncate", "corrupt"):
            proxy = grpc.aio.server(options=channel_options(MAX_FRAGMENT_BYTES))
            kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(_FaultyKvProxy(upstream, mode),
                                                                  proxy)
            ports[mode] = proxy.add_insecure_port(f"{HOST}:0")
            await proxy.start()
            servers.append(proxy)
        addresses.update({m: f"{HOST}:{p}" for m, p in ports.items()})

    servers: list[grpc.aio.Server] = []
    addresses: dict[str, str] = {}
    loop_thread.run(start(), 30)
    yield addresses
    for s in servers:
        loop_thread.run(s.stop(0), 30)


@pytest.mark.parametrize("mode", ["truncate", "corrupt"])
def test_partial_or_corrupt_kv_is_recomputed_or_fails(disagg_stack: Stack, colocated_stack: Stack,
                                                      prompts: list[list[int]], mode: str,
                                                      faulty_proxies: dict[str, str]) -> None:
    _, long = _long_prompt(prompts)
    # A prompt no other test used: the decode worker must not hold any of its blocks in its own
    # prefix cache, or it would pull only the tail and never see the damaged block 1.
    prompt = [(long[0] + 7 + len(mode)) % 1000 + 10, *long[1:]]
    want = generate(colocated_stack.grpc_target, prompt, ORACLE_MAX_TOKENS).token_ids
    with _worker_channel(disagg_stack, "prefill") as ch:
        first, second = _prefill(ch, prompt), _prefill(ch, prompt)
    for resp in (first, second):
        resp.kv_handle.worker_address = faulty_proxies[mode]
    with pytest.raises(grpc.RpcError) as info:  # fail first: recompute would cache the prompt
        _decode(disagg_stack, prompt, second, FAIL)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    out = _decode(disagg_stack, prompt, first, RECOMPUTE)
    assert out.complete.kv_recomputed
    assert out.token_ids == want
    # Neither lease was pulled whole: decode still drops them (no wait for their expiry).
    disagg_stack.wait_idle()


def test_handle_of_another_prompt_is_recomputed_or_invalid(
        disagg_stack: Stack, colocated_stack: Stack, prompts: list[list[int]]) -> None:
    """A handle whose blocks hold a different prompt of the same length (a mix-up upstream)."""
    _, prompt = _long_prompt(prompts)
    other = [prompt[0], (prompt[1] + 1) % 1000 + 10, *prompt[2:]]  # differs in block 0
    want = generate(colocated_stack.grpc_target, other, ORACLE_MAX_TOKENS).token_ids
    with _worker_channel(disagg_stack, "prefill") as ch:
        resp = _prefill(ch, prompt)
        fresh = prefill_pb2.PrefillResponse()
        fresh.CopyFrom(resp)
        fresh.first_token_id = want[0]  # the first token `other` would get
        out = _decode(disagg_stack, other, fresh, RECOMPUTE)
        assert out.complete.kv_recomputed
        assert out.token_ids == want
        with pytest.raises(grpc.RpcError) as info:
            _decode(disagg_stack, other, fresh, FAIL)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "block_hashes" in str(info.value.details())  # type: ignore[attr-defined]
        kv_transfer_pb2_grpc.KvTransferStub(ch).Release(
            kv_transfer_pb2.ReleaseRequest(request_id=resp.kv_handle.request_id),
            timeout=RPC_TIMEOUT_S)
    disagg_stack.wait_idle()


def test_lease_reused_for_another_prompt_is_never_used(
        disagg_stack: Stack, prompts: list[list[int]], oracle: list[Generated]) -> None:
    """The lease id was released and granted again for another prompt of the same length: the
    pulled blocks' hashes differ from the handle's, so decode must not use them."""
    index, prompt = _long_prompt(prompts)
    other = [prompt[0], (prompt[1] + 1) % 1000 + 10, *prompt[2:]]
    rid = f"reused-{uuid.uuid4().hex}"
    with _worker_channel(disagg_stack, "prefill") as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        kv = kv_transfer_pb2_grpc.KvTransferStub(ch)

        def prefill(ids: list[int]) -> prefill_pb2.PrefillResponse:
            r: prefill_pb2.PrefillResponse = stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=ids, sampling=greedy_sampling(ORACLE_MAX_TOKENS)),
                timeout=RPC_TIMEOUT_S)
            return r

        resp = prefill(prompt)
        assert kv.Release(kv_transfer_pb2.ReleaseRequest(request_id=rid), timeout=RPC_TIMEOUT_S).released
        prefill(other)  # lease `rid` now holds `other`'s KV
        out = _decode(disagg_stack, prompt, resp, RECOMPUTE)
        assert out.complete.kv_recomputed
        assert out.token_ids == oracle[index].token_ids
    disagg_stack.wait_idle()


def test_gateway_without_a_live_prefill_worker_serves_on_decode(
        loop_thread: LoopThread, disagg_stack: Stack, prompts: list[list[int]],
        oracle: list[Generated]) -> None:
    """A prefill pool whose only worker is gone: requests go whole to the decode worker
    (decode_only mode) with the oracle's tokens; with no worker of either pool, a clear 503 /
    UNAVAILABLE, never a 500 or a hang."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind((HOST, 0))
        dead = f"{HOST}:{s.getsockname()[1]}"
    decode = f"{HOST}:{disagg_stack.workers['decode'].port}"
    for decode_addresses in ((decode,), (dead,)):
        config = GatewayConfig(prefill_addresses=(dead,), decode_addresses=decode_addresses,
                               served_model_name=MODEL_NAME, max_model_len=MAX_MODEL_LEN,
                               max_prompt_tokens=MAX_MODEL_LEN, load_poll_interval_s=0.5,
                               shutdown_grace_s=1.0, internal_token=disagg_stack.internal_token)
        gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST,
                                grpc_port=0, tokenizer=disagg_stack.tokenizer)
        loop_thread.run(gateway.start(), 60)
        try:
            health = httpx.get(f"http://{HOST}:{gateway.rest_port}/health", timeout=HTTP_TIMEOUT)
            if decode_addresses == (decode,):
                assert health.json()["serving_mode"] == "decode_only"
                out = generate(f"{HOST}:{gateway.grpc_port}", prompts[0], ORACLE_MAX_TOKENS)
                assert out.token_ids == oracle[0].token_ids
                continue
            assert health.status_code == 503
            assert health.json()["serving_mode"] == "unavailable"
            resp = httpx.post(f"http://{HOST}:{gateway.rest_port}/v1/completions",
                              timeout=HTTP_TIMEOUT,
                              json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
            assert "no healthy" in _error(resp, 503)
            with grpc.insecure_channel(f"{HOST}:{gateway.grpc_port}") as ch, \
                    pytest.raises(grpc.RpcError) as info:
                list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
                    text="hi", sampling=greedy_sampling(4)), timeout=RPC_TIMEOUT_S))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        finally:
            loop_thread.run(gateway.stop(), 60)
    disagg_stack.wait_idle()


def test_handle_differing_only_in_the_partial_block_is_recomputed_or_invalid(
        disagg_stack: Stack, colocated_stack: Stack, prompts: list[list[int]]) -> None:
    """Block hashes cover full blocks only; the handle's prompt_hash covers the partial last
    block too, so decode refuses KV of a prompt that differs only there."""
    _, prompt = _long_prompt(prompts)
    assert len(prompt) % BLOCK_SIZE, "the prompt must end in a partial block"
    other = [*prompt[:-1], (prompt[-1] + 1) % 1000 + 10]
    want = generate(colocated_stack.grpc_target, other, ORACLE_MAX_TOKENS).token_ids
    with _worker_channel(disagg_stack, "prefill") as ch:
        resp = _prefill(ch, prompt)
        assert len(resp.kv_handle.prompt_hash) == 32
        resp.first_token_id = want[0]
        try:
            out = _decode(disagg_stack, other, resp, RECOMPUTE)
            with pytest.raises(grpc.RpcError) as info:
                _decode(disagg_stack, other, resp, FAIL)
        finally:
            kv_transfer_pb2_grpc.KvTransferStub(ch).Release(
                kv_transfer_pb2.ReleaseRequest(request_id=resp.kv_handle.request_id),
                timeout=RPC_TIMEOUT_S)
    disagg_stack.wait_idle()
    assert out.complete.kv_recomputed
    assert out.token_ids == want
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "prompt_hash" in str(info.value.details())  # type: ignore[attr-defined]


# ---- the gateway drops prefill leases no decode worker will pull ---------------------------------

@dataclass
class _FrontState:
    """Shared by the `_DecodeFront`s of one test: what they saw and did."""

    calls: int = 0
    failed: int = 0
    forwarded: int = 0
    with_handle: list[bool] = field(default_factory=list)   # per forwarded call: had a kv_handle
    recomputed: list[bool] = field(default_factory=list)    # per completed call: kv_recomputed


class _DecodeFront(decode_pb2_grpc.DecodeServicer):
    """A Decode peer in front of the real decode worker; GetLoad is forwarded, so the gateway
    routes to it. Decode by mode: "stall" never answers (a call that never reaches a worker),
    "fail_once" fails the first call of all fronts sharing `state` with UNAVAILABLE before it
    reaches the worker (the worker died) and forwards later ones, "forge" forwards with the
    handle's prompt_hash zeroed (the worker must refuse the handle and recompute)."""

    def __init__(self, upstream: str, mode: str, state: _FrontState) -> None:
        self.upstream = upstream
        self.mode = mode
        self.state = state

    async def GetLoad(self, request, context):  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(self.upstream) as channel:
            return await decode_pb2_grpc.DecodeStub(channel).GetLoad(request, timeout=5,
                                                                     metadata=UPSTREAM_AUTH)

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        self.state.calls += 1
        if self.mode == "stall":
            await asyncio.Event().wait()  # until the gateway cancels the call
        if self.mode == "fail_once" and not self.state.failed:
            self.state.failed += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode front: worker died")
        if self.mode == "forge":
            request.kv_handle.prompt_hash = bytes(32)
        self.state.forwarded += 1
        self.state.with_handle.append(request.HasField("kv_handle"))
        async with grpc.aio.insecure_channel(self.upstream) as channel:
            async for response in decode_pb2_grpc.DecodeStub(channel).Decode(
                    request, timeout=RPC_TIMEOUT_S, metadata=UPSTREAM_AUTH):
                if response.WhichOneof("response") == "complete":
                    self.state.recomputed.append(response.complete.kv_recomputed)
                yield response


@contextlib.contextmanager
def _gateway_via_fronts(loop_thread: LoopThread, stack: Stack, modes: list[str]
                        ) -> Iterator[tuple[GatewayServer, _FrontState]]:
    """A gateway on the stack's prefill worker whose decode pool is one `_DecodeFront` per mode,
    all in front of the stack's decode worker."""
    upstream = f"{HOST}:{stack.workers['decode'].port}"
    state = _FrontState()
    servers: list[grpc.aio.Server] = []

    async def start() -> list[str]:
        addresses = []
        for mode in modes:
            server = grpc.aio.server()
            decode_pb2_grpc.add_DecodeServicer_to_server(_DecodeFront(upstream, mode, state), server)
            addresses.append(f"{HOST}:{server.add_insecure_port(f'{HOST}:0')}")
            await server.start()
            servers.append(server)
        return addresses

    fronts = loop_thread.run(start(), 30)
    config = GatewayConfig(prefill_addresses=(f"{HOST}:{stack.workers['prefill'].port}",),
                           decode_addresses=tuple(fronts), served_model_name=MODEL_NAME,
                           max_model_len=MAX_MODEL_LEN, max_prompt_tokens=MAX_MODEL_LEN,
                           load_poll_interval_s=0.5, shutdown_grace_s=1.0,
                           internal_token=stack.internal_token)
    gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST, grpc_port=0,
                            tokenizer=stack.tokenizer)
    loop_thread.run(gateway.start(), 60)
    try:
        yield gateway, state
    finally:
        loop_thread.run(gateway.stop(), 60)
        for server in servers:
            loop_thread.run(server.stop(0), 30)


def _num_prefill_leases(stack: Stack) -> int:
    aengine = stack.workers["prefill"].aengine
    assert aengine is not None
    return len(aengine.engine.scheduler.leases)  # racy read of a dict size: polling only


def test_disconnect_before_decode_reaches_a_worker_releases_the_lease(
        loop_thread: LoopThread, disagg_stack: Stack) -> None:
    """The client hangs up after the first token while the Decode call is still on its way (no
    decode worker ever sees it): only the gateway can release the prefill lease."""
    disagg_stack.wait_idle()
    with _gateway_via_fronts(loop_thread, disagg_stack, ["stall"]) as (gateway, state):
        body = {"model": MODEL_NAME, "prompt": "Tell me about the sea.", "temperature": 0,
                "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=HTTP_TIMEOUT) as client, client.stream(
                "POST", f"http://{HOST}:{gateway.rest_port}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            # Keep the line iterator referenced: a dropped httpx iterator closes the stream,
            # which the gateway (rightly) sees as a disconnect before the check below.
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "[DONE]" not in first
            _wait_until(lambda: state.calls == 1, "the Decode call at the front")
            assert _num_prefill_leases(disagg_stack) == 1  # held for a pull that never comes
            del lines  # now hang up
        _wait_until(lambda: _num_prefill_leases(disagg_stack) == 0, "the prefill lease's release",
                    IDLE_TIMEOUT_S)
    assert state.forwarded == 0
    disagg_stack.wait_idle()


def test_decode_retry_releases_the_dropped_handle(loop_thread: LoopThread, disagg_stack: Stack,
                                                  prompts: list[list[int]],
                                                  oracle: list[Generated]) -> None:
    """A decode worker fails before pulling; the resume elsewhere recomputes without the handle,
    so the gateway releases the lease it dropped."""
    disagg_stack.wait_idle()
    index, prompt = _long_prompt(prompts)
    with _gateway_via_fronts(loop_thread, disagg_stack, ["fail_once", "fail_once"]) as (
            gateway, state):
        out = generate(f"{HOST}:{gateway.grpc_port}", prompt, ORACLE_MAX_TOKENS)
        _wait_until(lambda: _num_prefill_leases(disagg_stack) == 0, "the prefill lease's release",
                    IDLE_TIMEOUT_S)
    assert (state.calls, state.failed, state.forwarded) == (2, 1, 1)
    assert state.with_handle == [False]  # the resume recomputed prompt + first token
    assert out.token_ids == oracle[index].token_ids
    disagg_stack.wait_idle()


def test_handle_refused_by_decode_is_released_by_the_gateway(
        loop_thread: LoopThread, disagg_stack: Stack, prompts: list[list[int]],
        oracle: list[Generated]) -> None:
    """Decode refuses a handle that is not the prompt's (here: a wrong prompt_hash) and does not
    release a lease it judged foreign; the gateway, which owns the lease, does."""
    disagg_stack.wait_idle()
    index, prompt = _long_prompt(prompts)
    with _gateway_via_fronts(loop_thread, disagg_stack, ["forge"]) as (gateway, state):
        out = generate(f"{HOST}:{gateway.grpc_port}", prompt, ORACLE_MAX_TOKENS)
        _wait_until(lambda: _num_prefill_leases(disagg_stack) == 0, "the prefill lease's release",
                    IDLE_TIMEOUT_S)
    assert state.with_handle == [True] and state.recomputed == [True]
    assert out.token_ids == oracle[index].token_ids
    disagg_stack.wait_idle()


# ---- credentials stay with known peers -----------------------------------------------------------

class _RecordingKvTransfer(kv_transfer_pb2_grpc.KvTransferServicer):
    """A KvTransfer peer at a forged handle's address: records each call's metadata and has no
    lease to give."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def _record(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append((method, {k: v for k, v in context.invocation_metadata() or ()
                                    if isinstance(v, str)}))

    async def PullBlocks(self, request, context):  # type: ignore[no-untyped-def]
        self._record("PullBlocks", context)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")
        yield kv_transfer_pb2.KvFragment()  # unreachable: makes this a stream handler

    async def PullBlocksShm(self, request, context):  # type: ignore[no-untyped-def]
        self._record("PullBlocksShm", context)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")

    async def PullBlocksTcp(self, request, context):  # type: ignore[no-untyped-def]
        self._record("PullBlocksTcp", context)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")

    async def PullBlocksIpc(self, request, context):  # type: ignore[no-untyped-def]
        self._record("PullBlocksIpc", context)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease")

    async def Release(self, request, context):  # type: ignore[no-untyped-def]
        self._record("Release", context)
        return kv_transfer_pb2.ReleaseResponse(released=False)


def test_a_forged_handle_never_collects_the_cluster_secret(
        loop_thread: LoopThread, disagg_stack: Stack, prompts: list[list[int]]) -> None:
    """The decode worker pulls from (and releases at) whatever address a handle names, so its
    KV calls carry the lease's own ticket from the handle, never the cluster's secret; the real
    prefill worker takes that ticket for its own lease only."""
    disagg_stack.wait_idle()
    peer = _RecordingKvTransfer()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(peer, server)
        port = server.add_insecure_port(f"{HOST}:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(start(), 30)
    try:
        prompt = prompts[0]
        with _worker_channel(disagg_stack, "prefill") as ch:
            prefill = _prefill(ch, prompt)
        ticket = prefill.kv_handle.lease_ticket
        assert len(ticket) == 64
        forged = common_pb2.KvHandle()
        forged.CopyFrom(prefill.kv_handle)
        forged.worker_address = f"{HOST}:{port}"
        out = _decode(disagg_stack, prompt, prefill, RECOMPUTE, forged)
        assert out.complete.kv_recomputed
        _wait_until(lambda: any(m == "Release" for m, _ in peer.calls), "the forged release")
        assert peer.calls
        for method, metadata in peer.calls:
            assert INTERNAL_TOKEN not in " ".join(metadata.values()), method
            assert "authorization" not in metadata, method
            assert metadata.get("x-splitserve-lease-ticket") == ticket, method
        # The real lease: another request's ticket does not open it; its own does.
        with _worker_channel(disagg_stack, "prefill") as ch, grpc.insecure_channel(
                f"{HOST}:{disagg_stack.workers['prefill'].port}") as bare:
            stub = kv_transfer_pb2_grpc.KvTransferStub(bare)
            rid = prefill.kv_handle.request_id
            with pytest.raises(grpc.RpcError) as info:
                stub.Release(kv_transfer_pb2.ReleaseRequest(request_id=rid), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            other = _prefill(ch, prompt).kv_handle
            with pytest.raises(grpc.RpcError) as info:
                stub.Release(kv_transfer_pb2.ReleaseRequest(request_id=rid), timeout=10,
                             metadata=(("x-splitserve-lease-ticket", other.lease_ticket),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            for handle in (prefill.kv_handle, other):
                assert stub.Release(kv_transfer_pb2.ReleaseRequest(
                    request_id=handle.request_id), timeout=10, metadata=(
                    ("x-splitserve-lease-ticket", handle.lease_ticket),)).released
    finally:
        loop_thread.run(server.stop(0), 30)
    disagg_stack.wait_idle()


def test_a_handle_naming_an_address_outside_kv_peers_is_never_dialled(
        disagg_stack: Stack, prompts: list[list[int]]) -> None:
    """With --kv-peers naming the prefill worker, a handle forged to name another address is
    refused before any connection (recomputed, or PERMISSION_DENIED under policy fail) and
    counted; a handle naming the prefill worker is still pulled."""
    servicer = disagg_stack.workers["decode"].servicer
    assert isinstance(servicer, DecodeServicer)
    listener = socket.create_server((HOST, 0))  # a host:port nobody configured
    listener.setblocking(False)
    prompt = prompts[0]
    refused_before = servicer.kv_handles_refused
    servicer.kv_peers = KvPeers([f"{HOST}:{disagg_stack.workers['prefill'].port}"])
    try:
        with _worker_channel(disagg_stack, "prefill") as ch:
            forged_recompute, forged_fail, real = (_prefill(ch, prompt) for _ in range(3))
        for prefill in (forged_recompute, forged_fail):
            prefill.kv_handle.worker_address = f"{HOST}:{listener.getsockname()[1]}"
        out = _decode(disagg_stack, prompt, forged_recompute, RECOMPUTE,
                      forged_recompute.kv_handle)
        assert out.complete.kv_recomputed
        with pytest.raises(grpc.RpcError) as info:
            _decode(disagg_stack, prompt, forged_fail, FAIL, forged_fail.kv_handle)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        assert not _decode(disagg_stack, prompt, real, FAIL).complete.kv_recomputed
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected to it
        assert servicer.kv_handles_refused == refused_before + 2
        with _worker_channel(disagg_stack, "decode") as ch:
            report = decode_pb2_grpc.DecodeStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10)
        assert report.kv_handles_refused == refused_before + 2
    finally:
        servicer.kv_peers = None
        listener.close()
    with _worker_channel(disagg_stack, "prefill") as ch:  # the forged ones' leases
        stub = kv_transfer_pb2_grpc.KvTransferStub(ch)
        for prefill in (forged_recompute, forged_fail):
            stub.Release(kv_transfer_pb2.ReleaseRequest(
                request_id=prefill.kv_handle.request_id), timeout=10)
    disagg_stack.wait_idle()
