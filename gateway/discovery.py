"""Which workers a pool has: static `host:port` entries and gRPC's DNS target form.

A pool's targets (`--prefill`, `--decode`) are `host:port` entries, fixed for the gateway's
life, and `dns:[//DNS_SERVER[:PORT]/]NAME:PORT` entries: every A and AAAA record of NAME is a
worker on PORT (on Kubernetes NAME is a headless Service, which lists every ready pod).
`PoolDiscovery` re-resolves the DNS entries every `interval_s` seconds, sooner when the answer's
TTL is shorter, and hands the pool the union of all entries (`WorkerPool.set_members`): a new
address joins once its health check says SERVING, one that left is drained from routing.

A failed lookup (timeout, no server) keeps the last membership: a DNS hiccup must not empty a
pool. An empty answer (NXDOMAIN, no records) is an answer: that name has no workers now.
Lookups use dnspython's resolver (no DNS wire code here); a target without DNS_SERVER uses the
system's resolver configuration with its search domains (a short Service name resolves as it
does for any pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:"
DEFAULT_DNS_PORT = 53
# Lower bound on the time between two lookups of one target, whatever its TTL (a TTL of 0,
# dnsmasq's default for its own records, would otherwise mean a lookup loop).
MIN_REFRESH_S = 0.5
LOOKUP_TIMEOUT_S = 2.0
# host (no colon, or a bracketed IPv6 literal) then :port
_DNS_TARGET = re.compile(r"^dns:(?://(?P<server>[^/]*)/)?(?P<name>[^/:\[\]]+):(?P<port>\d+)$")


class DiscoveryError(ValueError):
    """A worker target that cannot be used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """`dns:[//server/]name:port`: every address of `name` is a worker on `port`."""

    name: str
    port: int
    server: tuple[str, int] | None = None  # (IP, port) of the DNS server; None: the system's

    def __str__(self) -> str:
        server = "" if self.server is None else f"//{self.server[0]}:{self.server[1]}/"
        return f"{DNS_SCHEME}{server}{self.name}:{self.port}"


def is_dns_target(target: str) -> bool:
    return target.startswith(DNS_SCHEME)


def parse_dns_target(target: str) -> DnsTarget:
    """`dns:[//DNS_SERVER[:PORT]/]NAME:PORT` (gRPC's form; DNS_SERVER an IP address)."""
    match = _DNS_TARGET.match(target.strip())
    if match is None:
        raise DiscoveryError(f"{target!r} is not a DNS target: use dns:[//DNS_SERVER/]NAME:PORT")
    port = _port(match["port"], target)
    server = match["server"]
    return DnsTarget(match["name"], port, None if not server else _server(server, target))


def _port(text: str, target: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise DiscoveryError(f"{target!r}: port {port} is outside 1..65535")
    return port


def _server(text: str, target: str) -> tuple[str, int]:
    """`IP`, `IP:PORT`, `[IPv6]` or `[IPv6]:PORT`."""
    host, port = text, DEFAULT_DNS_PORT
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), target)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(port_text, target)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise DiscoveryError(f"{target!r}: the DNS server must be an IP address, not "
                             f"{host!r}") from None
    return host, port


def check_targets(targets: Sequence[str], what: str) -> None:
    """Raise DiscoveryError for a malformed entry (at start-up, not at the first lookup)."""
    for target in targets:
        if is_dns_target(target):
            try:
                parse_dns_target(target)
            except DiscoveryError as err:
                raise DiscoveryError(f"{what}: {err}") from None
        elif target.rpartition(":")[0] == "" or not target.rpartition(":")[2].isdigit():
            raise DiscoveryError(f"{what}: {target!r} is neither host:port nor "
                                 "dns:[//DNS_SERVER/]NAME:PORT")


def worker_address(ip: str, port: int) -> str:
    """`ip:port`, an IPv6 address bracketed (what gRPC and the pool's keys expect)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsResolver:
    """A and AAAA lookups of `DnsTarget`s through dnspython, one resolver per DNS server."""

    def __init__(self, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._resolvers: dict[tuple[str, int] | None, dns.asyncresolver.Resolver] = {}

    def _resolver(self, server: tuple[str, int] | None) -> dns.asyncresolver.Resolver:
        resolver = self._resolvers.get(server)
        if resolver is None:
            resolver = dns.asyncresolver.Resolver(configure=server is None)
            if server is not None:
                resolver.nameservers = [server[0]]
                resolver.port = server[1]
            resolver.lifetime = self._timeout_s
            self._resolvers[server] = resolver
        return resolver

    async def resolve(self, target: DnsTarget) -> tuple[list[str], float | None]:
        """The target's worker addresses and the shortest TTL of the answer (None: no records).
        Raises `dns.exception.DNSException` when no server answered."""
        resolver = self._resolver(target.server)
        answers = await asyncio.gather(*(self._lookup(resolver, target, rdtype)
                                         for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)))
        addresses: list[str] = []
        ttls: list[float] = []
        for answer in answers:
            if answer is None or answer.rrset is None:
                continue
            ttls.append(float(answer.rrset.ttl))
            addresses += [worker_address(r.address, target.port) for r in answer.rrset]
        return sorted(set(addresses)), min(ttls, default=None)

    @staticmethod
    async def _lookup(resolver: dns.asyncresolver.Resolver, target: DnsTarget,
                      rdtype: dns.rdatatype.RdataType) -> dns.resolver.Answer | None:
        try:
            # search: a short name (a Service in the pod's namespace) goes through the search
            # domains as it would for any client of the system resolver.
            return await resolver.resolve(target.name, rdtype, search=target.server is None)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None


class PoolDiscovery:
    """Keeps one pool's membership equal to its targets' current answer.

    `on_members(addresses)` (the pool's `set_members`) is called after every refresh with the
    static entries plus every address the DNS entries resolved to."""

    def __init__(self, targets: Sequence[str], on_members: Callable[[list[str]], None], *,
                 interval_s: float, resolver: DnsResolver | None = None, what: str = "") -> None:
        check_targets(targets, what or "targets")
        self._static = [t for t in targets if not is_dns_target(t)]
        self._dns = [parse_dns_target(t) for t in targets if is_dns_target(t)]
        self._on_members = on_members
        self._interval_s = interval_s
        self._resolver = resolver or DnsResolver()
        self._last: dict[DnsTarget, list[str]] = {t: [] for t in self._dns}
        self._what = what
        self._task: asyncio.Task[None] | None = None

    @property
    def dynamic(self) -> bool:
        return bool(self._dns)

    def initial_members(self) -> list[str]:
        """The static entries: what the pool starts with before the first lookup."""
        return list(self._static)

    async def refresh(self) -> float:
        """Resolve every DNS entry once, publish the members; returns the seconds until the next
        refresh (the interval, or the answers' shortest TTL when shorter)."""
        delay = self._interval_s
        for target in self._dns:
            try:
                addresses, ttl = await self._resolver.resolve(target)
            except dns.exception.DNSException as err:
                log.warning("%s: looking up %s failed (keeping %d workers): %r", self._what,
                            target, len(self._last[target]), err)
                continue
            if addresses != self._last[target]:
                log.info("%s: %s -> %s", self._what, target, ", ".join(addresses) or "(none)")
            self._last[target] = addresses
            if ttl is not None:
                delay = min(delay, ttl)
        members = list(dict.fromkeys([*self._static, *(a for t in self._dns
                                                      for a in self._last[t])]))
        self._on_members(members)
        return max(MIN_REFRESH_S, delay)

    async def start(self) -> None:
        """One refresh now (so the pool knows its workers before serving), then in the
        background while there are DNS entries."""
        if not self._dns:
            return
        delay = await self.refresh()
        self._task = asyncio.create_task(self._run(delay), name=f"discovery-{self._what}")

    async def _run(self, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            delay = await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
