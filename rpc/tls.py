"""Mutual TLS for the calls between the services (gateway → workers, decode → prefill KV pulls).

Off unless configured, like the cluster secret (rpc/auth.py), and configured the same way, by
environment variables that every process of a deployment shares:

- `SPLITSERVE_TLS_CERT`, `SPLITSERVE_TLS_KEY`: this process's certificate chain and private key
  (PEM files). Workers present it as servers, and every process presents it as a client.
- `SPLITSERVE_TLS_CA`: the CA (PEM) whose certificates are trusted, both ways: a worker refuses
  a client without a certificate from it, and a client refuses a worker without one.
- `SPLITSERVE_TLS_SERVER_NAME` (default "splitserve-internal"): the name every worker's
  certificate must carry (subjectAltName DNS). Workers are reached by pod IP or loopback, so
  clients check this one name instead of the address they dial.

The three files go together: setting some of them is an error. With TLS on, a plaintext call
fails at the connection; the cluster secret still rides along (defense in depth). Torch-free.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from rpc.servers import bind_port

TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "SPLITSERVE_TLS_CERT", "SPLITSERVE_TLS_KEY", "SPLITSERVE_TLS_CA"
TLS_SERVER_NAME_ENV = "SPLITSERVE_TLS_SERVER_NAME"
DEFAULT_SERVER_NAME = "splitserve-internal"
MAX_PEM_BYTES = 1 << 20


class TlsConfigError(ValueError):
    """The TLS environment is incomplete or a file is unusable."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM contents and the name the workers' certificates carry."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str

    def server_credentials(self) -> grpc.ServerCredentials:
        """A worker's: its own certificate, and clients must present one from the CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's: trust the CA, present this process's certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@dataclass(frozen=True, slots=True)
class TlsPaths:
    """The PEM files of `tls_from_env`, for the `ssl` module (it loads a key from a file)."""

    cert: str
    key: str
    ca: str
    server_name: str

    def server_context(self) -> ssl.SSLContext:
        """A worker's plain-socket side (the KV data port): the same mutual TLS as its gRPC
        port: its own certificate, clients must present one from the CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A client's plain-socket side: trust the CA, check `server_name`, present this
        process's certificate. Wrap with `server_hostname=self.server_name`."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=self.ca)
        return ctx  # PROTOCOL_TLS_CLIENT: CERT_REQUIRED and check_hostname already


def tls_paths_from_env() -> TlsPaths | None:
    """The TLS files of this process (checked as `tls_from_env` checks them), or None."""
    if tls_from_env() is None:  # raises TlsConfigError for an incomplete or unusable set
        return None
    cert, key, ca = (os.environ[name].strip() for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV))
    name = os.environ.get(TLS_SERVER_NAME_ENV, "").strip() or DEFAULT_SERVER_NAME
    return TlsPaths(cert, key, ca, name)


def tls_from_env() -> TlsFiles | None:
    """The TLS configuration of this process, or None when none is set."""
    paths = [os.environ.get(name, "").strip() for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
    if not any(paths):
        return None
    if not all(paths):
        missing = [n for n, p in zip((TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV), paths, strict=True)
                   if not p]
        raise TlsConfigError(f"TLS needs {TLS_CERT_ENV}, {TLS_KEY_ENV} and {TLS_CA_ENV} "
                             f"together; missing: {', '.join(missing)}")
    name = os.environ.get(TLS_SERVER_NAME_ENV, "").strip() or DEFAULT_SERVER_NAME
    return _load(paths[0], paths[1], paths[2], name)


@functools.lru_cache(maxsize=4)
def _load(cert: str, key: str, ca: str, server_name: str) -> TlsFiles:
    """Read once per process (KV pulls open a channel per pull)."""
    return TlsFiles(read_pem(cert, TLS_CERT_ENV), read_pem(key, TLS_KEY_ENV),
                    read_pem(ca, TLS_CA_ENV), server_name)


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes (at most MAX_PEM_BYTES); TlsConfigError naming `what` otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise TlsConfigError(f"{what}: cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_PEM_BYTES or b"-----BEGIN " not in data:
        raise TlsConfigError(f"{what}: {path} is not a PEM file")
    return data


def internal_channel(target: str, *, options: Sequence[tuple[str, Any]] = (),
                     interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None
                     ) -> grpc.aio.Channel:
    """A channel to a worker: mutual TLS when configured, plaintext otherwise."""
    tls = tls_from_env()
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options),
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(
        target, tls.channel_credentials(),
        options=[*options, ("grpc.ssl_target_name_override", tls.server_name)],
        interceptors=interceptors)


def add_internal_port(server: grpc.aio.Server, address: str) -> int:
    """Bind a worker's port: mutual TLS when configured, plaintext otherwise; PortBindError
    (rpc/servers.py) if it cannot bind."""
    tls = tls_from_env()
    return bind_port(server, address, None if tls is None else tls.server_credentials())
