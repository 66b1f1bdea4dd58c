"""The child processes of `splitserve up`: started with a fresh log each, watched until healthy,
and explained when one dies (its exit status or the signal that killed it, and its log's last
lines), so a start-up failure reads as its cause rather than "see logs"."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from rpc.auth import INTERNAL_TOKEN_ENV

LOG_TAIL_LINES = 15


def spawn(name: str, args: list[str], log_dir: Path, token: str,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`splitserve serve ARGS` with its output in LOG_DIR/NAME.log, truncated first: a log
    holds one run, so its tail is this run's failure, not an older one's."""
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
    env = {**os.environ, "PYTHONUNBUFFERED": "1", INTERNAL_TOKEN_ENV: token, **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "splitserve", "serve", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def exit_reason(returncode: int) -> str:
    """How a child ended, in words: a signal (the kernel's OOM killer sends SIGKILL) or a
    status."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (out of memory? the kernel's OOM killer sends it; see `dmesg`)" if (
            -returncode == signal.SIGKILL) else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {returncode}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log (a child's own words on why it stopped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def death_report(name: str, proc: subprocess.Popen[bytes], log_dir: Path) -> str:
    """`name` ended: how, and the last lines of its log."""
    code = proc.returncode if proc.returncode is not None else proc.poll()
    head = f"splitserve: {name} {exit_reason(code if code is not None else 0)}"
    tail = log_tail(log_dir / f"{name}.log")
    if not tail:
        return f"{head} (its log {log_dir / f'{name}.log'} is empty)"
    indented = "\n".join("  | " + ln for ln in tail.splitlines())
    return f"{head}; the end of {log_dir / f'{name}.log'}:\n{indented}"


def ports_in_use(host: str, ports: Iterable[int]) -> list[int]:
    """The ports of `ports` something already listens on at `host`: starting beside it would
    fail (or, with port reuse, split traffic with an unrelated server)."""
    taken = []
    for port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR: a port with only TIME_WAIT connections left is free to listen on.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    taken.append(port)
                else:
                    raise
    return taken


def http_healthy(url: str, serving_mode: str | None = None) -> bool:
    """The gateway's /health answers 200 and, when `serving_mode` is given, names that mode: a
    gateway answers 200 as soon as one pool is up (degraded modes), but the stack `up` starts is
    ready only when the gateway serves with both pools."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status != 200:
                return False
            if serving_mode is None:
                return True
            body = json.loads(r.read() or b"{}")
            return isinstance(body, dict) and body.get("serving_mode") == serving_mode
    except (OSError, ValueError):
        return False


def grpc_healthy(address: str) -> bool:
    """A worker's gRPC health service answers SERVING (TLS when the stack uses it)."""
    from splitserve.health import check

    try:
        return asyncio.run(check(address, timeout_s=2.0)) == "SERVING"
    except Exception:  # an unreachable worker is simply not ready yet
        return False
