"""The terms both sides of the KvTransfer service (`splitserve.v1.KvTransfer`) share: message
sizes, how a prompt's tokens fill blocks, and the failure a pull reports (`KvTransferError`,
named by a reason the decode worker acts on)."""

from __future__ import annotations

import math

import grpc

DEFAULT_FRAGMENT_BYTES = 1 << 20
MAX_FRAGMENT_BYTES = (4 << 20) - (64 << 10)  # stays below gRPC's default 4 MiB message cap
MAX_REQUEST_ID_CHARS = 256
_MESSAGE_SLACK = 64 << 10  # room for the KvFragment fields around `data`


def channel_options(max_fragment_bytes: int = DEFAULT_FRAGMENT_BYTES) -> list[tuple[str, int]]:
    """Options for a client channel or server carrying KvFragments of <= max_fragment_bytes."""
    limit = max_fragment_bytes + _MESSAGE_SLACK
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def block_num_tokens(index: int, num_tokens: int, block_size: int) -> int:
    """Tokens in block `index` of a prompt of num_tokens: block_size except for the last one."""
    return min(block_size, num_tokens - index * block_size)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


class KvTransferError(Exception):
    """A KV pull or release failed; never partial data. `reason` is one of:
    not_found, fingerprint_mismatch, invalid_argument, deadline_exceeded, unavailable,
    cancelled, lease_lost (the lease ended during the transfer), rpc_error (other status), protocol (malformed fragment stream), wire (a block
    failed verification), count_mismatch (not the expected blocks/tokens)."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"KV transfer failed ({reason}): {message}")
        self.reason = reason
        self.code = code


_REASONS = {
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "fingerprint_mismatch",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.ABORTED: "lease_lost",
}


def rpc_failure(err: grpc.aio.AioRpcError) -> KvTransferError:
    """A failed call's KvTransferError, its reason named by the status code."""
    code = err.code()
    return KvTransferError(_REASONS.get(code, "rpc_error"), f"{code.name}: {err.details()}", code)
