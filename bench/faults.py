"""`splitserve bench faults`: the fault matrix and a soak against real processes on 127.0.0.1.

A gateway, one prefill and one decode worker, each `splitserve serve` in its own process
(bench/process_stack.py), under the mixed load of bench/load_mix.py. Each fault is applied
two seconds into a stretch of load and healed (restart, SIGCONT) a few seconds later; for each:
requests sent / completed / failed by what the client saw, greedy answers that differ from the
reference run (wrong tokens), the time from the fault to the first request started after it
that succeeded, the time back to disaggregated serving, and the KV blocks and leases still held
once the workers' lease time has passed (leaked). Then the gRPC fuzz (bench/grpc_fuzz.py), and
a soak: the same load for `--soak-s` seconds with each process's RSS and open file descriptors
sampled. Everything is bounded and stops by itself; the JSON goes to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.grpc_fuzz import FuzzReport, fuzz_forged_handles, fuzz_worker
from bench.load_mix import LoadMix, LoadStats
from bench.process_stack import (
    HOST,
    ServiceProcess,
    blocks_in_use,
    free_ports,
    load_report,
    proc_stats,
    spawn_worker,
    wait_idle,
    wait_serving,
)
from bench.results import build_result, write_json

LEASE_S = 20.0  # the workers' --kv-lease-ms (process_stack.WORKER_ENGINE_ARGS)
MODEL_NAME = "SmolLM2-135M-Instruct"


class FaultStack:
    """Gateway + prefill + decode processes; restartable on their ports."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.prefill = spawn_worker("prefill", log_dir)
        # KV only from the configured prefill worker (the fuzz's foreign handle is refused).
        self.decode = spawn_worker("decode", log_dir,
                                   extra_args=("--kv-peers", self.prefill.address))
        rest, grpc_port = free_ports(2)
        self.gateway = ServiceProcess("gateway", rest, [
            "--grpc-port", str(grpc_port), "--prefill", self.prefill.address,
            "--decode", self.decode.address, "--max-model-len", "1024",
            "--log-level", "warning"], log_dir / "gateway.log")

    @property
    def rest_url(self) -> str:
        return f"http://{HOST}:{self.gateway.port}"

    @property
    def processes(self) -> dict[str, ServiceProcess]:
        return {"gateway": self.gateway, "prefill": self.prefill, "decode": self.decode}

    def start(self) -> None:
        wait_serving(self.prefill)
        wait_serving(self.decode)
        self.gateway.start()
        self.wait_mode("disaggregated", 120)

    def mode(self) -> str | None:
        try:
            return str(httpx.get(f"{self.rest_url}/health", timeout=2).json()["serving_mode"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def wait_mode(self, mode: str, timeout_s: float) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.mode() == mode:
                return time.monotonic() - start
            time.sleep(0.1)
        return None

    def stop(self) -> None:
        for p in self.processes.values():
            p.stop()


def _restart(p: ServiceProcess) -> None:
    p.start()
    if p.role != "gateway":
        wait_serving(p)


def _faults(s: FaultStack) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (fault, heal)."""
    def kill(p: ServiceProcess) -> Callable[[], None]:
        return lambda: p.signal(signal.SIGKILL)

    def stop(p: ServiceProcess) -> Callable[[], None]:
        return lambda: p.signal(signal.SIGSTOP)

    def cont(p: ServiceProcess) -> Callable[[], None]:
        return lambda: p.signal(signal.SIGCONT)

    return {
        "sigkill_decode": (kill(s.decode), lambda: _restart(s.decode)),
        "sigkill_prefill": (kill(s.prefill), lambda: _restart(s.prefill)),
        "sigstop_decode_10s": (stop(s.decode), cont(s.decode)),
        "sigstop_prefill_10s": (stop(s.prefill), cont(s.prefill)),
        "sigkill_gateway": (kill(s.gateway), lambda: _restart(s.gateway)),
    }


async def _with_load(mix: LoadMix, action: Callable[[LoadStats], Any]) -> LoadStats:
    """Run `action(stats)` in a thread while the load runs; stop the load after it."""
    stats, stop = LoadStats(), asyncio.Event()
    load = asyncio.create_task(mix.run(stop, stats))
    try:
        await asyncio.to_thread(action, stats)
    finally:
        stop.set()
        await load
    return stats


def run_fault(s: FaultStack, mix: LoadMix, name: str, fault: Callable[[], None],
              heal: Callable[[], None], hold_s: float = 10.0) -> dict[str, Any]:
    timing: dict[str, float | None] = {}

    def action(stats: LoadStats) -> None:
        time.sleep(2.0)
        t_fault = time.monotonic()
        fault()
        time.sleep(hold_s)
        heal()
        timing["back_to_disaggregated_s"] = s.wait_mode("disaggregated", 120)
        time.sleep(3.0)  # requests on the healed stack
        timing["recover_s"] = stats.first_ok_after(t_fault)

    stats = asyncio.run(_with_load(mix, action))
    workers = [s.prefill, s.decode]
    idle_after = wait_idle(workers, LEASE_S + 10)
    leaked = {w.role: _held(w) for w in workers}
    return {"fault": name, **stats.summary(), **timing, "idle_after_s": idle_after,
            "leaked": leaked}


def _held(w: ServiceProcess) -> dict[str, int] | None:
    r = load_report(w.address, w.role)
    if r is None:
        return None
    return {"blocks": blocks_in_use(r), "leases": r.num_leases,
            "requests": r.num_running + r.num_waiting}


def run_fuzz(s: FaultStack, rounds: int) -> dict[str, object]:
    report = FuzzReport()
    alive = lambda: s.prefill.alive() and s.decode.alive()  # noqa: E731
    for i, w in enumerate((s.prefill, s.decode)):
        fuzz_worker(w.address, rounds, seed=i, report=report, alive=alive)
    fuzz_forged_handles(s.prefill.address, s.decode.address, report, alive)
    return report.summary()


def run_soak(s: FaultStack, mix: LoadMix, soak_s: float, every_s: float = 15.0
             ) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []

    def action(stats: LoadStats) -> None:
        start = time.monotonic()
        while True:
            t = time.monotonic() - start
            samples.append({"t_s": round(t, 1), **{
                name: proc_stats(p.pid) for name, p in s.processes.items()}})
            if t >= soak_s:
                return
            time.sleep(min(every_s, soak_s - t + 0.01))

    stats = asyncio.run(_with_load(mix, action))
    warm = next((x for x in samples if x["t_s"] >= 60), samples[0])
    per_process = {name: {"start": samples[0][name], "after_warmup": warm[name],
                          "end": samples[-1][name],
                          "max_rss_kib": max(x[name]["rss_kib"] for x in samples)}
                   for name in s.processes}
    return {"duration_s": soak_s, **stats.summary(), "processes": per_process,
            "samples": samples, "idle_after_s": wait_idle([s.prefill, s.decode], LEASE_S + 10)}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("faults", help="fault matrix, gRPC fuzz and soak on real processes")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--log-dir", default="/tmp/splitserve-faults")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--soak-s", type=float, default=600.0)
    p.add_argument("--fuzz-rounds", type=int, default=20)
    p.add_argument("--faults", default="all", help="comma list of fault names, or all / none")


def cmd_faults(args: argparse.Namespace) -> int:
    stack = FaultStack(Path(args.log_dir))
    try:
        stack.start()
        mix = LoadMix(stack.rest_url, MODEL_NAME, args.concurrency)
        asyncio.run(mix.take_reference())
        matrix = _faults(stack)
        names = (list(matrix) if args.faults == "all" else []
                 if args.faults == "none" else args.faults.split(","))
        results = []
        for name in names:
            fault, heal = matrix[name]
            results.append(run_fault(stack, mix, name, fault, heal))
            print(results[-1], flush=True)
        fuzz = run_fuzz(stack, args.fuzz_rounds)
        print({"fuzz": fuzz}, flush=True)
        soak = run_soak(stack, mix, args.soak_s) if args.soak_s > 0 else None
    finally:
        stack.stop()
    settings = {"command": "splitserve bench " + " ".join(sys.argv[2:]),
                "concurrency": args.concurrency, "soak_s": args.soak_s,
                "fuzz_rounds": args.fuzz_rounds, "lease_s": LEASE_S,
                "note": "2-core machine shared with other jobs (load average ~10): latencies "
                        "and recovery times are inflated by contention"}
    document = build_result("faults", MODEL_NAME, settings,
                            {"faults": results, "fuzz": fuzz, "soak": soak})
    if args.out:
        write_json(args.out, document)
    return 0
