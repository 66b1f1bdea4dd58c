"""`splitserve up`'s start-up as a new user meets it: a typo is refused by `up` itself, a taken
port is named before anything starts (never a "ready" answered by another server), and a child
that dies is explained: its exit status or killing signal, and its own last log lines, from
this run's log only."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve import up
from splitserve.supervise import death_report, exit_reason, ports_in_use
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[3]


def _up(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "splitserve", "up", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_an_unknown_flag_is_refused_by_up_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        up.main(["--prot", "37300"])
    assert info.value.code == 2
    assert "unrecognized arguments: --prot 37300" in capsys.readouterr().err


def test_a_taken_port_is_named_and_nothing_starts(tmp_path: Path) -> None:
    # The other services on free ports of their own: a default port (50062, say) can be an
    # outgoing connection's ephemeral port at the time, and would be named too.
    others = [flag for name in ("--grpc-port", "--prefill-port", "--decode-port")
              for flag in (name, str(free_port()))]
    with socket.socket() as other:  # another server on the REST port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert ports_in_use("127.0.0.1", [port]) == [port]
        out = _up("--port", str(port), *others, "--log-dir", str(tmp_path))
    assert out.returncode == 1
    assert f"port(s) {port} already in use" in out.stderr
    assert "ready" not in out.stdout
    assert not list(tmp_path.iterdir()), "no service was started"


def test_a_signal_death_is_reported_as_such_with_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    with open(log, "wb") as f:
        child = subprocess.Popen([sys.executable, "-c",
                                  "import os, signal; print('allocating the KV cache', "
                                  "flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
                                 stdout=f, stderr=subprocess.STDOUT)
        child.wait(timeout=30)
    report = death_report("decode", child, tmp_path)
    assert "decode was killed by SIGKILL (out of memory?" in report
    assert "| allocating the KV cache" in report
    assert exit_reason(3) == "exited with status 3"
    assert exit_reason(-signal.SIGTERM) == "was killed by SIGTERM"


@pytest.mark.timeout(180)
def test_a_worker_failing_at_start_prints_its_error_from_a_fresh_log(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "prefill.log").write_text("AN OLDER RUN'S FAILURE\n")
    ports = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    missing = tmp_path / "no-such-model"
    out = _up("--port", ports[0], "--grpc-port", ports[1], "--prefill-port", ports[2],
              "--decode-port", ports[3], "--log-dir", str(logs), "--model", str(missing),
              "--cpu-threads", "1", timeout=150)
    assert out.returncode == 1
    assert "ready" not in out.stdout
    assert "exited with status" in out.stderr, out.stderr
    assert str(missing) in out.stderr  # the worker's own error line, not "see logs"
    assert "AN OLDER RUN'S FAILURE" not in out.stderr
    assert "AN OLDER RUN'S FAILURE" not in (logs / "prefill.log").read_text()
