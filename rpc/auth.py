"""The credential a gRPC call carries: `authorization: Bearer <secret>` metadata.

Part of the wire contract like the `.proto` files (torch-free, importable by every package):

- internal calls (gateway -> prefill/decode workers, decode -> prefill KV pulls) carry the
  cluster's shared secret from the environment variable `SPLITSERVE_INTERNAL_TOKEN` (a
  Kubernetes Secret in k8s/, a random one per stack from `splitserve up`); workers started with
  it refuse calls without it;
- the gateway's public gRPC API takes the same header with the gateway's API key, as its REST
  API does.

Health checks stay open (Kubernetes' gRPC probes send no metadata). Secrets are compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc

INTERNAL_TOKEN_ENV = "SPLITSERVE_INTERNAL_TOKEN"
HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
MIN_SECRET_CHARS = 16


class AuthConfigError(ValueError):
    """A configured secret is unusable."""


def check_secret(secret: str, what: str) -> str:
    """A secret must be printable ASCII without spaces (it travels as a header value) and
    long enough not to be guessed."""
    if len(secret) < MIN_SECRET_CHARS or not all(33 <= ord(c) < 127 for c in secret):
        raise AuthConfigError(f"{what} must be at least {MIN_SECRET_CHARS} printable ASCII "
                              "characters without spaces")
    return secret


def internal_token_from_env() -> str | None:
    """The cluster's shared secret for internal calls, or None when it is not set."""
    value = os.environ.get(INTERNAL_TOKEN_ENV)
    if value is None or value == "":
        return None
    return check_secret(value.strip(), INTERNAL_TOKEN_ENV)


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `secret` (empty without one)."""
    return () if secret is None else (("authorization", f"Bearer {secret}"),)


def has_secret(metadata: Sequence[tuple[str, Any]] | None, secret: str) -> bool:
    """Whether call metadata carries `Bearer <secret>` (constant-time comparison)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  secret.encode()):
                return True
    return False


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without `Bearer <secret>` with UNAUTHENTICATED (except `open_methods`,
    by default the health checks)."""

    def __init__(self, secret: str, what: str,
                 open_methods: Collection[str] = HEALTH_METHODS) -> None:
        if not secret:
            raise AuthConfigError(f"{what} must not be empty")
        self._secret = secret
        self._what = what
        self._open = frozenset(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method in self._open
                or has_secret(handler_call_details.invocation_metadata, self._secret)):
            return handler
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                f"missing or invalid {self._what}: send the gRPC metadata "
                                "'authorization: Bearer <secret>'")


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                     message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with `code` (a server
    interceptor's refusal)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)


def _with_metadata(details: grpc.aio.ClientCallDetails, metadata: tuple[tuple[str, str], ...]
                   ) -> grpc.aio.ClientCallDetails:
    merged = (*(details.metadata or ()), *metadata)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*merged),
                                      details.credentials, details.wait_for_ready)


class _AddsMetadata:
    """The metadata an interceptor appends to every call it sees."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return _with_metadata(details, self._metadata)


# One class per call kind: a grpc.aio channel files each interceptor under the first kind it is
# an instance of, so one object implementing both would only ever see unary-unary calls.
class _UnaryUnaryMetadata(_AddsMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamMetadata(_AddsMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


def client_interceptors(secret: str | None) -> list[grpc.aio.ClientInterceptor] | None:
    """Interceptors for `grpc.aio.insecure_channel(..., interceptors=...)` that make every
    unary-request call on the channel (all of this project's RPCs) carry `secret` (None
    without one)."""
    if secret is None:
        return None
    metadata = bearer_metadata(secret)
    return [_UnaryUnaryMetadata(metadata), _UnaryStreamMetadata(metadata)]
