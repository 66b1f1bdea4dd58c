"""Where a decode worker may pull KV from: the operator's `--kv-peers` list.

A KV handle names the prefill worker that holds the lease (`worker_address`), and the decode
worker connects there to pull it. A handle is outside input (any caller of `Decode` can forge
one), so without a list a forged handle makes the decode worker dial any host:port it names.
With one, a handle naming an address outside it is refused before any connection is made.

Entries (comma separated on the command line):

- `HOST:PORT` — that worker (`[v6]:PORT` for an IPv6 literal);
- `HOST` — any port of that host;
- `CIDR` (`10.0.0.0/8`, `fd00::/8`) — any address in it, any port;
- `dns:[//SERVER/]NAME:PORT` (the gateway's `--prefill` form) — as `NAME:PORT`.

A HOST that is a name matches a handle naming it as written, or naming one of the addresses
it resolves to now (the system's resolver, answers kept `RESOLVE_TTL_S`): on Kubernetes, the
prefill pool's headless Service names every ready pod.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

RESOLVE_TTL_S = 5.0
_IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class _Peer:
    host: str                  # an IP literal or a name, lower case, no brackets
    port: int | None           # None: any port


def split_address(address: str) -> tuple[str, int | None]:
    """(host, port) of `host:port`, `[v6]:port`, `host` or `v6`; ValueError when malformed."""
    text = address.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{address!r} is not [IPv6]:PORT")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a name, an IPv4 literal or a bare IPv6 literal
        host, port_text = text, ""
    if not host:
        raise ValueError(f"{address!r} names no host")
    if not port_text:
        return host.lower(), None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{address!r}: port {port_text!r} is not in 1..65535")
    return host.lower(), int(port_text)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class KvPeers:
    """The addresses a decode worker may pull KV from."""

    def __init__(self, entries: Sequence[str]) -> None:
        """Raises ValueError naming the first entry that is not one of the module's forms."""
        self._networks: list[_IpNetwork] = []
        self._peers: list[_Peer] = []
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            if entry.startswith("dns:"):
                entry = entry[4:].split("/", 3)[-1] if entry.startswith("dns://") else entry[4:]
            if "/" in entry:
                try:
                    self._networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError:
                    raise ValueError(f"KV peer {entry!r} is not a CIDR network") from None
                continue
            host, port = split_address(entry)
            self._peers.append(_Peer(host, port))
        if not self._networks and not self._peers:
            raise ValueError("no KV peer given")
        self._resolved: dict[str, tuple[float, frozenset[str]]] = {}

    def __str__(self) -> str:
        return ",".join([*(str(n) for n in self._networks),
                         *(p.host if p.port is None else f"{p.host}:{p.port}"
                           for p in self._peers)])

    async def refusal(self, address: str) -> str | None:
        """Why a handle naming `address` must not be pulled from; None when it may be."""
        try:
            host, port = split_address(address)
        except ValueError as exc:
            return f"KV handle address {address!r} is malformed: {exc}"
        ip = _ip(host)
        if ip is not None and any(ip in net for net in self._networks):
            return None
        for peer in self._peers:
            if peer.port is not None and peer.port != port:
                continue
            if peer.host == host:
                return None
            if ip is not None and _ip(peer.host) is None and str(ip) in await self._resolve(peer.host):
                return None
        return (f"KV handle names {address}, which is not a configured KV peer "
                f"(--kv-peers {self})")

    async def _resolve(self, name: str) -> frozenset[str]:
        now = time.monotonic()
        cached = self._resolved.get(name)
        if cached is not None and now - cached[0] < RESOLVE_TTL_S:
            return cached[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None,
                                                                 type=socket.SOCK_STREAM)
            ips = frozenset(str(_ip(str(info[4][0]).split("%")[0])) for info in infos)
        except OSError:  # no answer: nothing of this name is allowed until one comes
            ips = frozenset()
        self._resolved[name] = (now, ips)
        return ips
