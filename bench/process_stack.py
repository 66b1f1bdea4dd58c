"""Services as real processes on 127.0.0.1 for fault and soak runs: each worker (and, when
asked, the gateway) is `splitserve serve --role ...` in its own process and session, so a
fault is a real signal (SIGKILL, SIGSTOP) to a real process, and its RSS and open file
descriptors can be read from /proc.

Used by `splitserve bench faults` (bench/faults.py) and the degraded-mode e2e tests. Every wait
is bounded; `ServiceProcess.stop` ends only the process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos.splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

HOST = "127.0.0.1"
# Small on purpose: two or three engines share a 2-core machine in the tests and the bench.
WORKER_ENGINE_ARGS = ("--max-model-len", "1024", "--num-gpu-blocks", "256", "--block-size", "16",
                      "--cpu-threads", "1", "--kv-lease-ms", "20000", "--log-level", "warning")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ServiceProcess:
    """One `splitserve serve --role ROLE` process; restartable on the same port."""

    role: str
    port: int
    args: Sequence[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        """Spawn it (again, after a kill) on its port; returns at once (see `wait_serving`)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child's stdout, closed after fork
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve", "serve", "--role", self.role, "--host", HOST,
                 "--port", str(self.port), *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            log.close()

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` (SIGKILL, SIGSTOP, SIGCONT) to this process alone."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (a stopped process is continued first)."""
        if not self.alive():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def spawn_worker(role: str, log_dir: Path, port: int | None = None,
                 extra_args: Sequence[str] = ()) -> ServiceProcess:
    """A prefill, decode or colocated worker process with `WORKER_ENGINE_ARGS`, started."""
    port = port if port is not None else free_ports(1)[0]
    worker = ServiceProcess(role, port, [*WORKER_ENGINE_ARGS, *extra_args],
                            log_dir / f"{role}-{port}.log")
    worker.start()
    return worker


def load_report(address: str, role: str, timeout_s: float = 2.0) -> common_pb2.LoadReport | None:
    """The worker's `GetLoad` answer, None when it does not answer (down, loading, stopped)."""
    with grpc.insecure_channel(address) as channel:
        stub = (prefill_pb2_grpc.PrefillStub(channel) if role == "prefill"
                else decode_pb2_grpc.DecodeStub(channel))
        try:
            report: common_pb2.LoadReport = stub.GetLoad(common_pb2.LoadRequest(),
                                                          timeout=timeout_s)
        except grpc.RpcError:
            return None
        return report


def wait_serving(worker: ServiceProcess, timeout_s: float = 300.0) -> None:
    """Until the worker answers `GetLoad` (its model loaded); RuntimeError with its log's tail
    when it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not worker.alive():
            raise RuntimeError(f"{worker.role} worker exited:\n{worker.log_tail()}")
        if load_report(worker.address, worker.role) is not None:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{worker.role} worker not serving after {timeout_s}s:\n"
                       f"{worker.log_tail()}")


def blocks_in_use(report: common_pb2.LoadReport) -> int:
    """KV blocks held by requests or leases (free and prefix-cached blocks are not)."""
    return report.num_blocks - report.num_free_blocks


def idle(report: common_pb2.LoadReport) -> bool:
    """No request running or waiting, no lease held, every KV block free (or only cached)."""
    return not (report.num_running or report.num_waiting or report.num_leases
                or blocks_in_use(report))


def wait_idle(workers: Sequence[ServiceProcess], timeout_s: float) -> float | None:
    """Seconds until every live worker of `workers` reports `idle`; None if one did not within
    `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        reports = [load_report(w.address, w.role) for w in workers if w.alive()]
        if all(r is not None and idle(r) for r in reports):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def proc_stats(pid: int) -> dict[str, int]:
    """RSS (KiB) and open file descriptors of process `pid` (Linux /proc)."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
