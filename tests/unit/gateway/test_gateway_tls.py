"""TLS on the gateway's public ports (`--ssl-certfile/--ssl-keyfile`, and `--ssl-ca-certs` for
client certificates), against fake workers: the real `openai` client over HTTPS, real gRPC
channels, certificates made with `openssl`."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import GatewayConfig, GatewayConfigError
from gateway.server import build_parser, config_from_args
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer
from tests.support.pki import ca_and_leaf

LOCAL = "DNS:localhost,IP:127.0.0.1"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gateway-pki")
    ca_and_leaf(root / "server", "localhost", LOCAL)
    ca_and_leaf(root / "client", "client", "DNS:client")  # another CA signs the clients
    ca_and_leaf(root / "rogue", "client", "DNS:client")
    return {"server": root / "server", "client": root / "client", "rogue": root / "rogue"}


@pytest.fixture(scope="module")
def script_ids() -> list[int]:
    return smollm2_tokenizer().encode(" Paris is the capital of France.", add_special_tokens=False)


def _tls(pki: dict[str, Path], client_ca: bool = False) -> dict[str, Any]:
    server = pki["server"]
    cfg = {"ssl_certfile": str(server / "leaf.pem"), "ssl_keyfile": str(server / "leaf.key")}
    if client_ca:
        cfg["ssl_ca_certs"] = str(pki["client"] / "ca.pem")
    return cfg


def _trust(ca: Path, cert: Path | None = None) -> ssl.SSLContext:
    """A client context trusting `ca`; with `cert`, presenting folder cert's leaf."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert / "leaf.pem"), str(cert / "leaf.key"))
    return ctx


def _https(h: Harness) -> str:
    assert h.gateway is not None
    return f"https://127.0.0.1:{h.gateway.rest_port}"


def _generate(channel: grpc.Channel) -> list[gateway_pb2.GenerateResponse]:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    return list(stub.Generate(gateway_pb2.GenerateRequest(
        text="Hello", model=MODEL_NAME, sampling=common_pb2.SamplingParams(max_tokens=3)),
        timeout=20))


@pytest.fixture(scope="module")
def tls_gateway(pki: dict[str, Path], script_ids: list[int]) -> Iterator[Harness]:
    with Harness(Script(list(script_ids)), **_tls(pki)) as h:
        yield h


def test_openai_client_over_https(tls_gateway: Harness, pki: dict[str, Path],
                                  script_ids: list[int]) -> None:
    client = OpenAI(base_url=_https(tls_gateway) + "/v1", api_key="x", max_retries=0,
                    http_client=openai.DefaultHttpxClient(verify=_trust(pki["server"] / "ca.pem")))
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4)
    assert out.choices[0].text == smollm2_tokenizer().decode(script_ids[:4])
    # Plain HTTP to the TLS port gets no answer; a client that does not trust the CA refuses.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{tls_gateway.gateway.rest_port}/health",  # type: ignore[union-attr]
                  timeout=5)
    untrusting = OpenAI(base_url=_https(tls_gateway) + "/v1", api_key="x", max_retries=0,
                        http_client=openai.DefaultHttpxClient(verify=_trust(pki["rogue"] / "ca.pem")))
    with pytest.raises(openai.APIConnectionError):
        untrusting.models.list()


def test_grpc_over_tls(tls_gateway: Harness, pki: dict[str, Path]) -> None:
    creds = grpc.ssl_channel_credentials((pki["server"] / "ca.pem").read_bytes())
    with grpc.secure_channel(tls_gateway.grpc_target, creds) as channel:
        out = _generate(channel)
    assert out[-1].WhichOneof("response") == "complete"
    with grpc.insecure_channel(tls_gateway.grpc_target) as channel, pytest.raises(grpc.RpcError):
        _generate(channel)


def test_client_certificates_required_when_a_client_ca_is_set(
        pki: dict[str, Path], script_ids: list[int]) -> None:
    server_ca = pki["server"] / "ca.pem"
    with Harness(Script(list(script_ids)), **_tls(pki, client_ca=True)) as h:
        health = _https(h) + "/health"
        mine = _trust(server_ca, pki["client"])
        assert httpx.get(health, verify=mine, timeout=5).status_code == 200
        # No certificate, or one the client CA did not sign: the handshake fails.
        for ctx in (_trust(server_ca), _trust(server_ca, pki["rogue"])):
            with pytest.raises(httpx.HTTPError):
                httpx.get(health, verify=ctx, timeout=5)
        root = (pki["server"] / "ca.pem").read_bytes()
        key_chain = [(p / "leaf.key").read_bytes() for p in (pki["client"], pki["rogue"])]
        chains = [(p / "leaf.pem").read_bytes() for p in (pki["client"], pki["rogue"])]
        good = grpc.ssl_channel_credentials(root, key_chain[0], chains[0])
        with grpc.secure_channel(h.grpc_target, good) as channel:
            assert _generate(channel)[-1].WhichOneof("response") == "complete"
        for creds in (grpc.ssl_channel_credentials(root),
                      grpc.ssl_channel_credentials(root, key_chain[1], chains[1])):
            with grpc.secure_channel(h.grpc_target, creds) as channel, \
                    pytest.raises(grpc.RpcError):
                _generate(channel)


def test_tls_settings_are_validated(pki: dict[str, Path], tmp_path: Path) -> None:
    base = {"decode_addresses": ("127.0.0.1:1",), "colocated": True}
    cert, key = str(pki["server"] / "leaf.pem"), str(pki["server"] / "leaf.key")
    with pytest.raises(GatewayConfigError, match="both or neither"):
        GatewayConfig(**base, ssl_certfile=cert)  # type: ignore[arg-type]
    with pytest.raises(GatewayConfigError, match="needs ssl_certfile"):
        GatewayConfig(**base, ssl_ca_certs=cert)  # type: ignore[arg-type]
    with pytest.raises(GatewayConfigError, match="cannot read"):
        GatewayConfig(**base, ssl_certfile=str(tmp_path / "nope.pem"),  # type: ignore[arg-type]
                      ssl_keyfile=key)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(GatewayConfigError, match="not a PEM file"):
        GatewayConfig(**base, ssl_certfile=str(junk), ssl_keyfile=key)  # type: ignore[arg-type]
    args = build_parser().parse_args(["--colocated", "--decode", "127.0.0.1:1",
                                      "--ssl-certfile", cert, "--ssl-keyfile", key])
    config = config_from_args(args)
    assert config.tls and config.ssl_certfile == cert and config.ssl_ca_certs is None
