"""gRPC servers' shared binding rules: no port reuse, and a port that cannot be bound is a clear
start-up error.

grpc enables SO_REUSEPORT by default, so a second server can bind a port a running one holds
and the kernel splits new connections between the two (unrelated stacks answering each other's
clients). Every server here turns it off: a taken port fails to bind.
"""

from __future__ import annotations

from typing import Any

import grpc

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (("grpc.so_reuseport", 0),)


class PortBindError(OSError):
    """A gRPC server could not bind its address (in use, or not an address of this host)."""


def bind_port(server: grpc.aio.Server, address: str,
              credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `address` (TLS with `credentials`) → the bound port; PortBindError if it cannot be
    bound (grpc reports that as 0 or as a RuntimeError, depending on the version)."""
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as err:
        raise PortBindError(f"cannot bind gRPC port {address}: already in use, or not an "
                            f"address of this host ({err})") from None
    if port == 0:
        raise PortBindError(f"cannot bind gRPC port {address}: already in use, or not an "
                            "address of this host")
    return port
