"""A real DNS server for discovery tests: dnsmasq on 127.0.0.1, answering from its own hosts
file, reloaded (SIGHUP) when the test changes the records.

`.ci/run` installs dnsmasq (Debian's package) when it is absent; `dnsmasq_or_skip` skips a test
only when the binary is still not there. The server runs in the foreground (`--no-daemon`),
reads no system configuration (`--conf-file=/dev/null`, `--no-resolv`, `--no-hosts`), answers
only for its test domain (`--local`: names it lacks are NXDOMAIN, not forwarded), on a free port.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.resolver
import pytest

DOMAIN = "fleet.test"


def dnsmasq_or_skip() -> str:
    path = shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if Path(p).is_file()), None)
    if path is None:
        pytest.skip("dnsmasq is not installed (.ci/run installs it: apt-get install -y dnsmasq)")
    return path


def free_udp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_dns_port(host: str = "127.0.0.1") -> int:
    """A port free for both UDP and TCP at `host` right now (dnsmasq listens on both)."""
    while True:
        port = free_udp_port(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port


class Dnsmasq:
    """dnsmasq serving `records` (name -> IPv4 addresses) with TTL `ttl_s` on 127.0.0.1:port."""

    def __init__(self, directory: Path, ttl_s: int = 30) -> None:
        self.binary = dnsmasq_or_skip()
        self.hosts = directory / "hosts"
        self.hosts.write_text("")
        self.port = free_dns_port()
        self.ttl_s = ttl_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def server(self) -> str:
        """The `//DNS_SERVER/` part of a `dns:` target naming this server."""
        return f"127.0.0.1:{self.port}"

    def start(self, records: Mapping[str, Sequence[str]]) -> None:
        """Start serving `records`; a port taken between its choice and dnsmasq's bind (another
        test's server) is replaced by a fresh one, twice at most."""
        for attempt in range(3):
            try:
                self._start(records)
                return
            except AssertionError as e:
                if "Address already in use" not in str(e) or attempt == 2:
                    raise
                self.port = free_dns_port()

    def _start(self, records: Mapping[str, Sequence[str]]) -> None:
        self._write(records)
        self._proc = subprocess.Popen(
            [self.binary, "--no-daemon", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             f"--addn-hosts={self.hosts}", f"--local=/{DOMAIN}/", "--listen-address=127.0.0.1",
             "--bind-interfaces", f"--port={self.port}", f"--local-ttl={self.ttl_s}",
             "--pid-file=", "--user=root", "--group=root"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_for(records)

    def set_records(self, records: Mapping[str, Sequence[str]]) -> None:
        """Rewrite the hosts file, reload it (SIGHUP) and wait until the server answers so."""
        assert self._proc is not None
        self._write(records)
        self._proc.send_signal(signal.SIGHUP)
        self._wait_for(records)

    def lookup(self, name: str) -> list[str]:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = self.port
        resolver.lifetime = 1.0
        try:
            return sorted(r.address for r in resolver.resolve(name, "A"))
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)

    def _write(self, records: Mapping[str, Sequence[str]]) -> None:
        self.hosts.write_text("".join(f"{ip} {name}\n" for name, ips in records.items()
                                      for ip in ips))

    def _wait_for(self, records: Mapping[str, Sequence[str]], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise AssertionError(f"dnsmasq exited ({self._proc.returncode}): {err}")
            try:
                if all(self.lookup(n) == sorted(ips) for n, ips in records.items()):
                    return
            except dns.exception.DNSException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"dnsmasq on port {self.port} does not answer {records}")
            time.sleep(0.05)
