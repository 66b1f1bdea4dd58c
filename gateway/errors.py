"""One error type for every failure a client sees, with the gRPC ↔ HTTP status mapping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import grpc

# docs/architecture.md, "Conventions": status ↔ HTTP.
_HTTP_BY_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_CODE_BY_INT: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status code (500 for anything not listed)."""
    return _HTTP_BY_CODE.get(code, 500)


def status_code_from_int(value: int) -> grpc.StatusCode:
    """A `grpc.StatusCode` from its wire integer (as carried by `StreamError.code`)."""
    return _CODE_BY_INT.get(value, grpc.StatusCode.UNKNOWN)


class GatewayError(Exception):
    """A failure to report to the client.

    `code` is the gRPC status (the REST layer maps it with `http_status`); `param` names the
    offending request field for validation errors; `error_code` is the OpenAI-style short code.
    """

    def __init__(self, code: grpc.StatusCode, message: str, *, param: str | None = None,
                 error_code: str | None = None, http: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.error_code = error_code
        self._http = http

    @property
    def http_status(self) -> int:
        return self._http if self._http is not None else http_status(self.code)

    def renamed(self, rename: Callable[[str], str]) -> GatewayError:
        """The same error with the field paths in its `param` and message renamed, for a front
        door that names the request's fields otherwise than the checks that raised it (gRPC's
        `chat.messages.0`, the Responses API's `max_output_tokens` for chat's `max_tokens`)."""
        return GatewayError(self.code, rename(self.message),
                            param=None if self.param is None else rename(self.param),
                            error_code=self.error_code, http=self._http)

    @classmethod
    def invalid(cls, param: str | None, message: str) -> GatewayError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError, hop: str) -> GatewayError:
        """Wrap a downstream RPC failure, keeping its status (so 429/503/504 reach the client)."""
        details = err.details() or err.code().name
        return cls(err.code(), f"{hop} worker: {details}")


ShedReason = Literal["gateway_limit", "workers_overloaded"]


class OverloadedError(GatewayError):
    """Load shed: RESOURCE_EXHAUSTED (429 with `Retry-After` over REST) for a request refused
    because there is no room for it now, not because it was wrong; the client may retry.

    `reason` (the refused-requests metric's label): "gateway_limit", this gateway's bound on
    requests in flight (`--max-concurrent-requests`); "workers_overloaded", every worker of a
    pool refused the call (their `--max-queued-requests`)."""

    def __init__(self, reason: ShedReason, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.reason: ShedReason = reason
