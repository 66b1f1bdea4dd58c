"""The credential a gRPC call carries: `authorization: Bearer <secret>` metadata.

Part of the wire contract like the `.proto` files (torch-free, importable by every package):

- internal calls (gateway -> prefill/decode workers) carry the cluster's shared secret from
  the environment variable `SPLITSERVE_INTERNAL_TOKEN` (a Kubernetes Secret in k8s/, a random
  one per stack from `splitserve up`); workers started with it refuse calls without it;
- the gateway's public gRPC API takes the same header with the gateway's API key, as its REST
  API does.

Health checks stay open (Kubernetes' gRPC probes send no metadata). Secrets are compared in
constant time and never logged.

A decode worker's KV calls (pulls, releases) carry no cluster secret: they go to the address a
KV handle names, and a forged handle must not collect the secret. They carry the lease's own
ticket instead (`LeaseTickets`: an HMAC of the request id under a key the prefill worker draws
at start), which the prefill worker put in the handle and which opens that lease alone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc

INTERNAL_TOKEN_ENV = "SPLITSERVE_INTERNAL_TOKEN"
HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
MIN_SECRET_CHARS = 16
LEASE_TICKET_KEY = "x-splitserve-lease-ticket"  # call metadata carrying a lease's ticket


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


class LeaseTickets:
    """A prefill worker's lease tickets: the ticket of request `r`'s lease is
    HMAC-SHA256(key, r), the key drawn at random per process, so nothing is stored and a ticket
    opens the one lease it was issued for (KvTransferServicer checks it)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    def ticket(self, request_id: str) -> str:
        return hmac.new(self._key, request_id.encode(), hashlib.sha256).hexdigest()

    def valid(self, request_id: str, ticket: str) -> bool:
        return hmac.compare_digest(self.ticket(request_id).encode(), ticket.encode())


def lease_ticket_metadata(ticket: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a lease's ticket (empty without one)."""
    return ((LEASE_TICKET_KEY, ticket),) if ticket else ()


def lease_ticket_of(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The lease ticket a call carries, or None."""
    for key, value in metadata or ():
        if key == LEASE_TICKET_KEY and isinstance(value, str):
            return value
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without `Bearer <secret>` with UNAUTHENTICATED (except `open_methods`,
    by default the health checks). A call to one of `ticketed_methods` may carry a lease
    ticket instead: it is let through, and the servicer checks the ticket against the lease
    the request names."""

    def __init__(self, secret: str, what: str,
                 open_methods: Collection[str] = HEALTH_METHODS,
                 ticketed_methods: Collection[str] = ()) -> None:
        if not secret:
            raise AuthConfigError(f"{what} must not be empty")
        self._secret = secret
        self._what = what
        self._open = frozenset(open_methods)
        self._ticketed = frozenset(ticketed_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method, metadata = handler_call_details.method, handler_call_details.invocation_metadata
        if (handler is None or method in self._open or has_secret(metadata, self._secret)
                or (method in self._ticketed and lease_ticket_of(metadata) is not None)):
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
