"""The gateway's gRPC port as an operator and a client meet it: bound where REST is (loopback by
default), never shared with another server, Health/List answered, and text without special
tokens unless a request asks for them (vLLM's default)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.server import GatewayServer
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc.servers import PortBindError
from tests.support.gateway_fakes import Harness, Script, smollm2_tokenizer

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def gw() -> Iterator[Harness]:
    tok = smollm2_tokenizer()
    ids = [*tok.encode(" Paris", add_special_tokens=False), *tok.encode(IM_END,
                                                                      add_special_tokens=False)]
    with Harness(Script(ids), log_requests=True) as h:
        yield h


def _text(gw: Harness, **fields: object) -> str:
    fields.setdefault("text", "Hi")
    with grpc.insecure_channel(gw.grpc_target) as ch:
        out = gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(max_tokens=8), **fields), timeout=20)  # type: ignore[arg-type]
        return "".join(r.chunk.text for r in out if r.WhichOneof("response") == "chunk")


def test_special_tokens_are_skipped_unless_asked_for(gw: Harness) -> None:
    assert _text(gw) == " Paris"  # unset: vLLM's default, skipped
    assert _text(gw, skip_special_tokens=True) == " Paris"
    assert _text(gw, skip_special_tokens=False) == " Paris" + IM_END


def test_requests_are_logged_without_their_text(gw: Harness,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """--enable-log-requests: one line per request, its id and settings, never the prompt."""
    with caplog.at_level(logging.INFO, logger="gateway.orchestrator"):
        _text(gw, request_id="logged-request-1", text="a secret prompt")
    lines = [r.getMessage() for r in caplog.records if "logged-request-1" in r.getMessage()]
    assert len(lines) == 1 and "max_tokens=8" in lines[0]
    assert "secret" not in caplog.text


def test_health_list_names_every_service(gw: Harness) -> None:
    with grpc.insecure_channel(gw.grpc_target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5)
    assert {name: s.status for name, s in reply.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "splitserve.v1.Gateway": health_pb2.HealthCheckResponse.SERVING}


def test_a_second_gateway_on_a_taken_grpc_port_fails_to_start(gw: Harness) -> None:
    """grpc's default SO_REUSEPORT would let it bind beside the first and split the traffic."""
    assert gw.gateway is not None
    second = GatewayServer(gw.gateway.config, rest_port=0, grpc_port=gw.gateway.grpc_port,
                           tokenizer=gw.tokenizer)
    with pytest.raises(PortBindError, match="in use"):
        gw.run(second.start())
    gw.run(second.stop())


def test_both_ports_bind_loopback_by_default(gw: Harness) -> None:
    """One bind setting, loopback unless told: another loopback address (as any other
    interface would be) is refused on the gRPC port as on the REST port."""
    assert gw.gateway is not None
    server = GatewayServer(gw.gateway.config, rest_port=0, grpc_port=0, tokenizer=gw.tokenizer)
    gw.run(server.start())
    try:
        for port in (server.grpc_port, server.rest_port):
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex(("127.0.0.2", port)) != 0
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex(("127.0.0.1", port)) == 0
    finally:
        gw.run(server.stop())
