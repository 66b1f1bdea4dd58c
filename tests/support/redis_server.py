"""A redis-server of a test's own on a free 127.0.0.1 port, for fault cases the shared Redis
must never see: killed, paused (SIGSTOP), restarted, full.

No persistence (nothing written to disk); every wait is bounded; `stop` (also at exit of the
context manager) kills the process whatever state it is in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process; `start` again after `kill` restarts it on the same port."""

    def __init__(self, *args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is required by the tier fault tests (apt-get install "
                        "redis-server; .ci/run installs it)")
        self._binary = binary
        self._args = args
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self._args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"redis-server on port {self.port} did not start")

    def pause(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients, as a crash."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=START_TIMEOUT_S)
            self._proc = None

    def stop(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGCONT)  # a paused one must see the kill
            self.kill()


@contextlib.contextmanager
def redis_server(*args: str) -> Iterator[RedisServer]:
    server = RedisServer(*args)
    server.start()
    try:
        yield server
    finally:
        server.stop()
