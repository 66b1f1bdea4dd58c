"""Raw KV blocks over a TCP connection of their own (`PullBlocksTcp`): the way between hosts.

The gRPC stream (`PullBlocks`) moves 0.3–0.45 GB/s: every block is encoded, checksummed, cut
into messages and put back together in Python. Here the prefill worker's data listener sends
the lease's blocks raw and back to back with `sendall`, and the puller `recv_into`s a staging
buffer it reuses and writes each batch into its cache: the kernel does the copying, and the
GIL is released while it does.

    decode worker                                prefill worker
    PullBlocksTcp(request_id, fingerprint) ───►  the checks of every pull, then a ticket
                                                 (32 random bytes, one connection, expires),
                                                 the data port, the lease's hashes and scales
    connect(worker host, data port), ticket ──►  the ticket's lease, if still live and still
                                                 the same blocks: n × block_nbytes raw bytes,
    recv_into staging → sink.write_blocks  ◄───  then one status byte: 1 if the lease still
                                                 held them after the last read (0: it expired
                                                 meanwhile, the blocks may have been reused),
                                                 then close

Authentication: the ticket is the capability. It comes over the gRPC call, which carries the
cluster's credential (rpc/auth.py) and is mutual TLS when configured; it opens one
connection, before it expires. A connection gets TICKET_WAIT_S to present one, among a bounded
number doing so (the oldest closed past it), and a sending slot only once it has: idle or
ticketless connections cannot delay a puller's. With TLS configured (rpc/tls.py) the data connection is
mutual TLS too, with the same certificates and server name. Integrity: TCP's checksum (TLS's
MAC when on), no per-block CRC (as for shared memory); the puller checks the byte count, and
the lease's hashes against its handle before it reads a byte, and the status byte after the
last one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kv_transfer import MAX_TCP_STREAMS

log = logging.getLogger(__name__)

TICKET_BYTES = 32
DEFAULT_TICKET_TTL_S = 30.0
DEFAULT_MAX_CONNECTIONS = 32
# Connections not yet past their ticket, at most: past it the oldest is closed to admit a new
# one, so idle or slow ones (a scan, a flood) hold neither a sending slot nor a puller's turn.
DEFAULT_MAX_UNAUTHENTICATED = 16
# A connection must present its ticket this soon, or it is closed. A puller sends it right
# after connecting (and its TLS handshake): milliseconds.
TICKET_WAIT_S = 2.0
# The server reads (device to host) and sends a lease this many blocks at a time, the next
# slice's read running while the current one is sent.
SEND_SLICE_BLOCKS = 16
_MAX_TICKETS = 4096  # outstanding; past it the oldest are dropped (each holds a few ids)
STATUS_OK, STATUS_LEASE_LOST = b"\x01", b"\x00"  # the byte after the blocks


def stripes(num_blocks: int, streams: int) -> list[tuple[int, int]]:
    """(first, count) of each connection's contiguous share of num_blocks blocks: at most
    min(streams, MAX_TCP_STREAMS, num_blocks) shares, the first ones one block longer."""
    k = max(1, min(streams, MAX_TCP_STREAMS, num_blocks))
    base, extra = divmod(num_blocks, k)
    out, first = [], 0
    for i in range(k):
        count = base + (1 if i < extra else 0)
        out.append((first, count))
        first += count
    return out


class TcpUnavailable(Exception):
    """The data port cannot be reached (refused, unroutable, timed out connecting, TLS
    handshake refused): the puller uses the next way; nothing was received."""


class TcpTransferError(Exception):
    """The connection broke or ended early after it was established; blocks may be partial."""


class _Lease(Protocol):
    @property
    def block_ids(self) -> list[int]: ...


class DataSource(Protocol):
    """What the data server reads: `kv_transfer.servicer.KvBlockSource` satisfies it."""

    def lookup(self, request_id: str) -> _Lease | None: ...

    def read_blocks(self, block_ids: list[int]) -> Coroutine[Any, Any, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class _Ticket:
    request_id: str
    first_block: int
    block_ids: tuple[int, ...]
    deadline: float  # time.monotonic()


class KvDataServer:
    """The prefill worker's data listener: serves each ticket's blocks once, raw.

    source: the KV block source (its coroutines run on `loop`, the service's event loop, as
    gRPC pulls read them). tls: a server context (`TlsPaths.server_context`) or None for
    plaintext. Threads: one accepting, one per live connection. A connection first has
    TICKET_WAIT_S to present a valid ticket, among at most max_unauthenticated such (the
    oldest closed to admit a new one); only then does it take one of max_connections sending
    slots (past that it waits, up to io_timeout_s, for one to end, so many pullers are served in
    turn rather than refused). Mutates: its ticket table and its set of connections awaiting
    their ticket under `_lock`.
    """

    def __init__(self, source: DataSource, loop: asyncio.AbstractEventLoop, host: str,
                 port: int = 0, tls: ssl.SSLContext | None = None,
                 ticket_ttl_s: float = DEFAULT_TICKET_TTL_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 io_timeout_s: float = 30.0,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED) -> None:
        if (ticket_ttl_s <= 0 or max_connections < 1 or io_timeout_s <= 0
                or max_unauthenticated < 1):
            raise ValueError("ticket_ttl_s and io_timeout_s must be > 0, max_connections and "
                             "max_unauthenticated >= 1")
        self._source, self._loop, self._tls = source, loop, tls
        self._ttl_s, self._io_timeout_s = ticket_ttl_s, io_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_unauthenticated = max_unauthenticated
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Ticket] = {}
        # Connections awaiting their ticket, oldest first (dict order).
        self._unauthenticated: dict[socket.socket, None] = {}
        self._closed = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-data-accept",
                                          daemon=True)
        self._acceptor.start()
        log.info("KV data port %s:%d (%s)", host, self.port, "TLS" if tls else "plaintext")

    # ------------------------------------------------------------------ called by the servicer

    def issue(self, request_id: str, first_block: int, block_ids: list[int]) -> bytes:
        """A single-use ticket for these blocks of the lease: block_ids are the lease's blocks
        first_block, first_block + 1, ... (a stripe of a pull)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._tickets.items() if t.deadline <= now]:
                del self._tickets[key]
            while len(self._tickets) >= _MAX_TICKETS:
                del self._tickets[next(iter(self._tickets))]  # the oldest (insertion order)
            self._tickets[ticket] = _Ticket(request_id, first_block, tuple(block_ids),
                                            now + self._ttl_s)
        return ticket

    def close(self) -> None:
        """Stop accepting; connections already sending finish or time out on their own."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(timeout=5)

    # ------------------------------------------------------------------ threads

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # e.g. EMFILE: do not spin
                continue
            self._admit(conn, peer)
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-data-send",
                             daemon=True).start()

    def _admit(self, conn: socket.socket, peer: Any) -> None:
        """Count `conn` among the connections awaiting their ticket, closing the oldest of them
        when there are already max_unauthenticated (its thread then ends at once)."""
        with self._lock:
            oldest = (next(iter(self._unauthenticated))
                      if len(self._unauthenticated) >= self._max_unauthenticated else None)
            if oldest is not None:
                del self._unauthenticated[oldest]
            self._unauthenticated[conn] = None
        if oldest is not None:
            log.warning("KV data port: %d connections without a ticket yet; closing the "
                        "oldest to admit one from %s", self._max_unauthenticated, peer)
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)  # its recv returns: its thread closes it

    def _wait_for_slot(self) -> bool:
        deadline = time.monotonic() + self._io_timeout_s
        while not self._slots.acquire(timeout=0.25):
            if self._closed.is_set() or time.monotonic() > deadline:
                return False
        return True

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        sock: socket.socket = conn
        slot = False
        try:
            sock.settimeout(TICKET_WAIT_S)
            if self._tls is not None:
                sock = self._tls.wrap_socket(conn, server_side=True)
            ticket = self._take(_recv_exactly(sock, TICKET_BYTES))
            with self._lock:
                self._unauthenticated.pop(conn, None)
            if ticket is None:
                log.warning("KV data port: a connection from %s without a valid ticket", peer)
                return
            slot = self._wait_for_slot()
            if not slot:
                log.warning("KV data port: no connection ended in %.0f s; closing one from %s",
                            self._io_timeout_s, peer)
                return
            sock.settimeout(self._io_timeout_s)
            self._send_blocks(sock, ticket)
        except (OSError, TcpTransferError, TimeoutError) as exc:
            log.info("KV data connection from %s ended: %s", peer, exc)
        except Exception:  # a bug: log it, keep the listener
            log.exception("KV data connection from %s failed", peer)
        finally:
            with self._lock:
                self._unauthenticated.pop(conn, None)
            with contextlib.suppress(OSError):
                sock.close()
            if slot:
                self._slots.release()

    def _take(self, raw: bytes) -> _Ticket | None:
        """The ticket's record, removed (single use); None if unknown, expired or its lease is
        gone or holds other blocks now."""
        with self._lock:
            ticket = self._tickets.pop(raw, None)
        if ticket is None or ticket.deadline <= time.monotonic():
            return None
        return ticket if self._still_leased(ticket) else None

    def _still_leased(self, ticket: _Ticket) -> bool:
        """Whether the ticket's lease lives and still holds its blocks."""
        lease = self._source.lookup(ticket.request_id)
        end = ticket.first_block + len(ticket.block_ids)
        return lease is not None and tuple(lease.block_ids[ticket.first_block:end]) == ticket.block_ids

    def _send_blocks(self, sock: socket.socket, ticket: _Ticket) -> None:
        ids = list(ticket.block_ids)
        slices = [ids[i:i + SEND_SLICE_BLOCKS] for i in range(0, len(ids), SEND_SLICE_BLOCKS)]
        pending = self._read(slices[0])
        for i in range(len(slices)):
            blocks = pending.result(timeout=self._io_timeout_s)
            if i + 1 < len(slices):
                pending = self._read(slices[i + 1])  # read the next slice while this one goes
            raw = blocks.contiguous().view(torch.uint8).reshape(-1)
            sock.sendall(raw.numpy().data)
        # Every read is done: had the lease ended before one of them, its blocks could have
        # been handed to another request and the bytes sent would not be this lease's KV.
        sock.sendall(STATUS_OK if self._still_leased(ticket) else STATUS_LEASE_LOST)

    def _read(self, block_ids: list[int]) -> Future[torch.Tensor]:
        return asyncio.run_coroutine_threadsafe(self._source.read_blocks(block_ids), self._loop)


# ----------------------------------------------------------------------------- client side


def receive_blocks(host: str, port: int, ticket: bytes, num_blocks: int, block_nbytes: int,
                   staging: torch.Tensor, on_batch: Callable[[int, int], None],
                   timeout_s: float, tls: ssl.SSLContext | None = None,
                   server_name: str | None = None) -> None:
    """Connect to a data port, present `ticket`, and read num_blocks raw blocks.

    staging: a CPU uint8 tensor of a whole number of blocks (its size is the batch); after each
    batch lands in it, `on_batch(first, count)` is called (blocks [first, first + count) of the
    transfer, in staging[:count * block_nbytes]) and must be done with staging when it returns.
    Blocking: call it in a thread. Raises TcpUnavailable when no connection could be made,
    TcpTransferError when one broke or ended early, or the server's status byte says the lease
    ended before its blocks were all read (on_batch may have run: the blocks written are not to
    be used), TimeoutError past timeout_s in all.
    """
    batch = staging.numel() // block_nbytes
    if staging.dtype != torch.uint8 or staging.device.type != "cpu" or batch < 1:
        raise ValueError("staging must be a CPU uint8 tensor of at least one block")
    if len(ticket) != TICKET_BYTES or num_blocks < 1:
        raise ValueError(f"a ticket is {TICKET_BYTES} bytes and a transfer >= 1 block")
    deadline = time.monotonic() + timeout_s
    sock = _connect(host, port, min(timeout_s, 10.0), tls, server_name)
    try:
        sock.sendall(ticket)
        view = staging.numpy().data.cast("B")
        for first in range(0, num_blocks, batch):
            count = min(batch, num_blocks - first)
            nbytes = count * block_nbytes
            got = 0
            while got < nbytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"KV data transfer past its {timeout_s:.0f} s deadline")
                sock.settimeout(left)
                n = sock.recv_into(view[got:nbytes], nbytes - got)
                if n == 0:
                    raise TcpTransferError(
                        f"the data port closed after {first * block_nbytes + got} of "
                        f"{num_blocks * block_nbytes} bytes (ticket refused, lease gone, or "
                        f"the worker stopped)")
                got += n
            on_batch(first, count)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        if _recv_exactly(sock, 1) != STATUS_OK:
            raise TcpTransferError("the lease ended before the prefill worker read all its "
                                   "blocks: what arrived may be another request's KV")
    except (ConnectionError, ssl.SSLError) as exc:
        raise TcpTransferError(f"KV data connection broke: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _connect(host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None,
             server_name: str | None) -> socket.socket:
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TcpUnavailable(f"cannot connect to {host}:{port}: {exc}") from exc
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=server_name)
    except (OSError, ssl.SSLError) as exc:
        sock.close()
        raise TcpUnavailable(f"TLS with {host}:{port} failed: {exc}") from exc


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes from sock; TcpTransferError if it closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TcpTransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)
