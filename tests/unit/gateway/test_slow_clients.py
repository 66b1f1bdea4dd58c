"""A streaming client that stops reading is cut after `stream_send_timeout_s` (REST and gRPC):
its request ends (slot given back, downstream calls over), other requests are served meanwhile
(gateway/streaming.py, gateway/grpc_server.py). Fake workers (real gRPC servers), real gateway."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest

from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer
from tests.support.prom import sample_value

MAX_TOKENS = 20000  # far more SSE than the socket buffers hold


@pytest.fixture(scope="module")
def gw() -> Iterator[Harness]:
    ids = list(smollm2_tokenizer().encode(" Paris is the capital of France."))
    with Harness(Script(ids, endless=True), stream_send_timeout_s=1.0, max_model_len=32768,
                 max_tokens_cap=MAX_TOKENS, request_timeout_s=60.0) as h:
        yield h


def _metric(h: Harness, name: str, **labels: str) -> float:
    """The sample's value; 0 for a labelled counter not counted yet."""
    try:
        return sample_value(httpx.get(h.base_url + "/metrics", timeout=10).text, name,
                            **labels)
    except AssertionError:
        return 0.0


def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait for `predicate`. The cut comes once the server has filled the socket buffers
    (megabytes of SSE from the scripted endless stream) and then waited out its 1 s send
    timeout: 20 s was not enough on a 2-core machine at load 1.5 running the suite (the test
    took 20.4 s there, 31 s for both tests alone on the same machine)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s}s"
        time.sleep(0.05)


def _served_meanwhile(h: Harness) -> None:
    r = httpx.post(h.base_url + "/v1/completions", timeout=10,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_a_rest_client_that_stops_reading_is_cut(gw: Harness) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": MAX_TOKENS,
                       "stream": True}).encode()
    port = int(gw.base_url.rsplit(":", 1)[1])
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                       b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        # It reads nothing from here on.
        _served_meanwhile(gw)
        _until(lambda: _metric(gw, "splitserve:stream_send_timeouts_total", api="rest") == 1,
               "the stream's cut")
        _until(lambda: _metric(gw, "splitserve:gateway_requests_in_flight") == 0,
               "the request's end")
        _served_meanwhile(gw)


def test_a_grpc_client_that_stops_reading_is_cut(gw: Harness) -> None:
    before = _metric(gw, "splitserve:requests_aborted_total", api="grpc")
    # A small flow-control window (no BDP probing): the client stops taking data soon.
    with grpc.insecure_channel(gw.grpc_target, options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            text="x", model=MODEL_NAME, sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS)), timeout=60)
        next(call)  # the stream started; nothing more is read
        _served_meanwhile(gw)
        _until(lambda: _metric(gw, "splitserve:stream_send_timeouts_total", api="grpc") == 1,
               "the call's end")
        _until(lambda: _metric(gw, "splitserve:gateway_requests_in_flight") == 0,
               "the request's end")
        assert _metric(gw, "splitserve:requests_aborted_total", api="grpc") == before + 1
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
