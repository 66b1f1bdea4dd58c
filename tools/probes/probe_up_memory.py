"""Resident memory of `splitserve up` with its defaults (the embedded SmolLM2), once it serves.

Starts the stack on free loopback ports, waits for "ready", sends one chat request, then reads
each process's VmRSS, VmHWM (its peak) and PSS (shared pages counted once across the stack)
from /proc: `up` itself, the gateway, the prefill and the decode worker. The figure that must
fit a 4 GB machine is the PSS total.

Usage: PYTHONPATH=. python3 tools/probes/probe_up_memory.py --out F [-- UP_FLAGS...]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.results import git_info


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def measure(up_flags: list[str]) -> dict[str, Any]:
    rest, grpc_port, prefill, decode = _free_ports(4)
    logs = tempfile.mkdtemp(prefix="probe_up_memory_")
    cmd = [sys.executable, "-m", "splitserve", "up", "--port", str(rest), "--grpc-port",
           str(grpc_port), "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--log-dir", logs, *up_flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ready" in line:
                break
        else:
            raise SystemExit(f"up stopped before ready; logs in {logs}")
        ready_s = time.monotonic() - started
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of "
                                                                    "France?"}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{rest}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        names = {proc.pid: "up"}
        for child in _children(proc.pid):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            role = cmdline[cmdline.index(b"--role") + 1].decode() if b"--role" in cmdline else "?"
            names[child] = role
        processes = {name: {"rss_mib": round(_status_kb(pid, "VmRSS") / 1024, 1),
                            "peak_rss_mib": round(_status_kb(pid, "VmHWM") / 1024, 1),
                            "pss_mib": round(_pss_kb(pid) / 1024, 1)}
                     for pid, name in names.items()}
        return {"ready_s": round(ready_s, 1), "answer": answer, "processes": processes,
                "total_rss_mib": round(sum(p["rss_mib"] for p in processes.values()), 1),
                "total_peak_rss_mib": round(sum(p["peak_rss_mib"] for p in processes.values()), 1),
                "total_pss_mib": round(sum(p["pss_mib"] for p in processes.values()), 1)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("up_flags", nargs="*", help="after --: flags for `splitserve up`")
    args = p.parse_args()
    result = measure(args.up_flags)
    result["git"] = git_info()
    result["command"] = ("PYTHONPATH=. python3 tools/probes/probe_up_memory.py --out F"
                         + (" -- " + " ".join(args.up_flags) if args.up_flags else ""))
    result["notes"] = ("2-core CPU host shared with other jobs (timings under contention); "
                       "memory figures do not depend on the load")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
