"""Authentication (rpc/auth.py): the workers of the disaggregated e2e stack require the cluster
secret (every disaggregated e2e test runs with it, KV pulls included); here, that calls without
it are refused, health checks stay open, and the gateway's gRPC API takes its API key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from gateway.config import GatewayConfig, GatewayConfigError  # noqa: E402
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
from rpc.auth import (  # noqa: E402
    INTERNAL_TOKEN_ENV,
    AuthConfigError,
    BearerAuthInterceptor,
    bearer_metadata,
    client_interceptors,
    has_secret,
    internal_token_from_env,
)
from tests.support.e2e_stack import HOST, INTERNAL_TOKEN, Stack, worker_channel  # noqa: E402
from tests.support.gateway_fakes import Harness, Script  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]

API_KEY = "gateway-api-key-0123456789"


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()  # type: ignore[attr-defined, no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("metadata", [(), bearer_metadata("not-the-cluster-secret-000"),
                                      (("authorization", INTERNAL_TOKEN),)],
                         ids=["none", "wrong", "no-bearer-scheme"])
def test_workers_refuse_calls_without_the_cluster_secret(
        disagg_stack: Stack, metadata: tuple[tuple[str, str], ...]) -> None:
    prefill = f"{HOST}:{disagg_stack.workers['prefill'].port}"
    decode = f"{HOST}:{disagg_stack.workers['decode'].port}"
    with grpc.insecure_channel(prefill) as p, grpc.insecure_channel(decode) as d:
        calls = [
            lambda: prefill_pb2_grpc.PrefillStub(p).Prefill(prefill_pb2.PrefillRequest(
                request_id="x", prompt_token_ids=[1, 2]), metadata=metadata, timeout=10),
            lambda: list(kv_transfer_pb2_grpc.KvTransferStub(p).PullBlocks(
                kv_transfer_pb2.PullBlocksRequest(request_id="x"), metadata=metadata,
                timeout=10)),
            lambda: kv_transfer_pb2_grpc.KvTransferStub(p).Release(
                kv_transfer_pb2.ReleaseRequest(request_id="x"), metadata=metadata, timeout=10),
            lambda: decode_pb2_grpc.DecodeStub(d).GetLoad(common_pb2.LoadRequest(),
                                                          metadata=metadata, timeout=10),
            lambda: list(decode_pb2_grpc.DecodeStub(d).Decode(decode_pb2.DecodeRequest(
                request_id="x", prompt_token_ids=[1]), metadata=metadata, timeout=10)),
        ]
        assert [_code(c) for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * len(calls)
        # Kubernetes' gRPC probes send no metadata: health stays open.
        for ch in (p, d):
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    # With the secret the same worker answers (and the whole stack serves through it).
    with worker_channel(disagg_stack, "decode") as ch:
        report = decode_pb2_grpc.DecodeStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=10)
        assert report.role == "decode"
    disagg_stack.wait_idle()


@pytest.fixture(scope="module")
def keyed_gateway() -> Iterator[Harness]:
    with Harness(Script([5, 6, 7, 8]), api_key=API_KEY) as h:
        yield h


def _generate(target: str, metadata: tuple[tuple[str, str], ...]) -> list[int]:
    with grpc.insecure_channel(target) as ch:
        out = gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]),
            sampling=common_pb2.SamplingParams(max_tokens=3)), metadata=metadata, timeout=20)
        return [t for r in out if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]


def test_gateway_grpc_api_requires_its_api_key(keyed_gateway: Harness) -> None:
    target = keyed_gateway.grpc_target
    for bad in [(), bearer_metadata("wrong-key-0123456789")]:
        with pytest.raises(grpc.RpcError) as info:
            _generate(target, bad)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        assert "API key" in str(info.value.details())  # type: ignore[attr-defined]
    assert _generate(target, bearer_metadata(API_KEY)) == [5, 6, 7]
    with grpc.insecure_channel(target) as ch:  # health needs no key
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=10).status in (
            health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)


def test_secret_from_environment_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    assert internal_token_from_env() is None
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "")
    assert internal_token_from_env() is None
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "x" * 32)
    assert internal_token_from_env() == "x" * 32
    for bad in ("short", "has a space in it 0123456789", "ünïcödé-0123456789abc"):
        monkeypatch.setenv(INTERNAL_TOKEN_ENV, bad)
        with pytest.raises(AuthConfigError, match="printable ASCII"):
            internal_token_from_env()
    with pytest.raises(GatewayConfigError, match="internal_token"):
        GatewayConfig(decode_addresses=("127.0.0.1:1",), colocated=True, internal_token="short")


def test_has_secret_checks_scheme_and_value() -> None:
    secret = "s" * 20
    assert has_secret([("authorization", f"Bearer {secret}")], secret)
    assert has_secret([("x-other", "1"), ("authorization", f"bearer  {secret} ")], secret)
    assert not has_secret([("authorization", secret)], secret)
    assert not has_secret([("authorization", f"Basic {secret}")], secret)
    assert not has_secret([("authorization", f"Bearer {secret}x")], secret)
    assert not has_secret([("x-authorization", f"Bearer {secret}")], secret)
    assert not has_secret(None, secret)


class _EchoDecode(decode_pb2_grpc.DecodeServicer):
    async def GetLoad(self, request: Any, context: Any) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(role="decode")

    async def Decode(self, request: Any, context: Any) -> Any:
        keys = {m.key for m in context.invocation_metadata()}
        seen = [int(k in keys) for k in ("authorization", "traceparent")]
        yield decode_pb2.DecodeResponse(chunk=decode_pb2.DecodeChunk(token_ids=seen))


def test_client_interceptors_cover_unary_and_streaming_calls() -> None:
    # A grpc.aio channel files an interceptor under one call kind only: each kind needs its own.
    secret = "c" * 24

    async def run() -> tuple[str, list[int]]:
        server = grpc.aio.server(interceptors=[BearerAuthInterceptor(secret, "secret")])
        decode_pb2_grpc.add_DecodeServicer_to_server(_EchoDecode(), server)
        port = server.add_insecure_port(f"{HOST}:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(
                    f"{HOST}:{port}", interceptors=client_interceptors(secret)) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                load = await stub.GetLoad(common_pb2.LoadRequest(), timeout=10)
                out = [r async for r in stub.Decode(decode_pb2.DecodeRequest(request_id="x"),
                                                     metadata=(("traceparent", "t"),),
                                                     timeout=10)]
                return load.role, list(out[0].chunk.token_ids)
        finally:
            await server.stop(0)

    role, seen = asyncio.run(run())
    assert role == "decode"
    assert seen == [1, 1]  # the secret, and the call's own metadata kept
    assert client_interceptors(None) is None
