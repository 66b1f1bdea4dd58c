"""A fleet on one host: two gateways find 2 prefill + 2 decode workers through a real DNS server
(dnsmasq), workers on distinct loopback addresses sharing one port per role (pods behind
headless Services). Requests spread over all four (each worker's own /metrics counts them),
a shared prefix goes back to one prefill worker, a decode worker that leaves DNS and gets a
real SIGTERM drains without failing a request or leaving a lease, and a worker added to DNS
takes requests within two discovery intervals.

Workers run the random `dummy:tiny` model (512-token vocabulary: prompts are token ids below
it) so the whole module costs seconds; one decode worker is a real `python -m decode_service`
process, so that SIGTERM is a real signal.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.config import CacheConfig, EngineConfig, LoadConfig, Role, RunnerConfig, SchedulerConfig
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from rpc.auth import INTERNAL_TOKEN_ENV
from tests.support.dnsmasq import DOMAIN, Dnsmasq
from tests.support.e2e_stack import (
    HOST,
    INTERNAL_TOKEN,
    LoopThread,
    generate,
    start_worker,
    wait_engines_idle,
    wait_healthy,
)
from worker.server import MetricsOptions, WorkerHandle

pytest_plugins = ["tests.support.e2e_stack"]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "dummy:tiny"
PREFILL, DECODE = f"prefill.{DOMAIN}", f"decode.{DOMAIN}"
P1, P2, D1, D2, D3 = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"
DISCOVERY_S = 1.0
POLL_S = 0.25
LOAD_TIMEOUT_S = 120.0
ENGINE = dict(block_size=16, num_blocks=256, max_model_len=512)


def free_tcp_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of `hosts` (tried a few times: another test may take it)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port free on all of {hosts}")


def engine_config(role: Role) -> EngineConfig:
    return EngineConfig(
        load=LoadConfig(model=MODEL, dtype="float32"),
        cache=CacheConfig(block_size=ENGINE["block_size"], num_gpu_blocks=ENGINE["num_blocks"]),
        scheduler=SchedulerConfig(role=role, max_model_len=ENGINE["max_model_len"],
                                  kv_lease_ms=300_000),
        runner=RunnerConfig(device="cpu"))


@dataclass
class Fleet:
    loop: LoopThread
    dns: Dnsmasq
    workers: dict[str, WorkerHandle]  # in-process, by address (D3: not in DNS at first)
    process: subprocess.Popen[bytes]  # the decode worker on D2
    process_metrics: str              # its /metrics URL
    gateways: list[GatewayServer]
    prefill_port: int
    decode_port: int

    def target(self, gateway: int = 0) -> str:
        return f"{HOST}:{self.gateways[gateway].grpc_port}"

    def metrics_url(self, host: str) -> str:
        if host == D2:
            return self.process_metrics
        metrics = self.workers[host].metrics
        assert metrics is not None
        return f"http://{host}:{metrics.port}/metrics"

    def calls(self, host: str, method: str) -> int:
        """`method` calls the worker on `host` accepted, from its own /metrics."""
        return int(sample(self.metrics_url(host), "splitserve:engine_calls_started_total",
                          method=method))


def sample(url: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text page (0 when absent); `model_name` is always checked."""
    text = httpx.get(url, timeout=10).text
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        assert got.get("model_name") == MODEL, line
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _decode_process(port: int, metrics_port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, INTERNAL_TOKEN_ENV: INTERNAL_TOKEN,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "decode_service", "--host", D2, "--port", str(port),
            "--model", MODEL, "--dtype", "float32", "--device", "cpu",
            "--block-size", str(ENGINE["block_size"]), "--num-gpu-blocks",
            str(ENGINE["num_blocks"]), "--max-model-len", str(ENGINE["max_model_len"]),
            "--metrics-port", str(metrics_port), "--drain-timeout", "20", "--log-level",
            "warning"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _gateway_config(dns: Dnsmasq, prefill_port: int, decode_port: int) -> GatewayConfig:
    return GatewayConfig(
        prefill_addresses=(f"dns://{dns.server}/{PREFILL}:{prefill_port}",),
        decode_addresses=(f"dns://{dns.server}/{DECODE}:{decode_port}",),
        served_model_name=MODEL, max_model_len=ENGINE["max_model_len"],
        max_prompt_tokens=ENGINE["max_model_len"], load_poll_interval_s=POLL_S,
        discovery_interval_s=DISCOVERY_S, shutdown_grace_s=2.0, internal_token=INTERNAL_TOKEN)


def _wait_serving(gateway: GatewayServer, prefill: int, decode: int, timeout_s: float) -> None:
    """Until the gateway routes to `prefill` and `decode` healthy workers."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = gateway.state
        assert state is not None and state.router.prefill is not None
        if (state.router.prefill.num_healthy, state.router.decode.num_healthy) == (prefill,
                                                                                    decode):
            return
        assert time.monotonic() < deadline, (state.router.prefill.num_healthy,
                                             state.router.decode.num_healthy)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    dns = Dnsmasq(tmp_path_factory.mktemp("dns"))
    prefill_port, decode_port = free_tcp_port((P1, P2)), free_tcp_port((D1, D2, D3))
    metrics_port = free_tcp_port((D2,))
    process = _decode_process(decode_port, metrics_port)
    workers: dict[str, WorkerHandle] = {}
    gateways: list[GatewayServer] = []
    try:
        dns.start({PREFILL: [P1, P2], DECODE: [D1, D2]})
        for host, role, port in ((P1, "prefill", prefill_port), (P2, "prefill", prefill_port),
                                 (D1, "decode", decode_port), (D3, "decode", decode_port)):
            workers[host] = loop_thread.run(start_worker(
                engine_config(role), host, port, auth_token=INTERNAL_TOKEN,  # type: ignore[arg-type]
                metrics=MetricsOptions(host, 0, MODEL)), 60)
        loads = [w.load_task for w in workers.values() if w.load_task is not None]
        loop_thread.run(asyncio.wait_for(asyncio.gather(*loads), LOAD_TIMEOUT_S),
                        LOAD_TIMEOUT_S + 5)
        config = _gateway_config(dns, prefill_port, decode_port)
        for _ in range(2):
            tokenizer = gateways[0].state.tokenizer if gateways and gateways[0].state else None
            gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST,
                                    grpc_port=0, tokenizer=tokenizer)
            gateways.append(gateway)
            loop_thread.run(gateway.start(), 120)
        for gateway in gateways:
            wait_healthy(f"http://{HOST}:{gateway.rest_port}/health", 60)
            _wait_serving(gateway, 2, 2, LOAD_TIMEOUT_S)  # the process loads meanwhile
        yield Fleet(loop_thread, dns, workers, process,
                    f"http://{D2}:{metrics_port}/metrics", gateways, prefill_port, decode_port)
    finally:
        for gateway in gateways:
            loop_thread.run(gateway.stop(), 60)
        for w in workers.values():
            loop_thread.run(w.stop(1.0), 60)
        if process.poll() is None:
            process.kill()
            process.wait(10)
        dns.stop()


def _prompt(i: int, length: int = 24) -> list[int]:
    return [3 + (i * 37 + j * 11) % 500 for j in range(length)]


def test_two_gateways_spread_over_every_worker_and_keep_prefixes_together(fleet: Fleet) -> None:
    hosts = (P1, P2, D1, D2)
    before = {h: fleet.calls(h, "Prefill" if h in (P1, P2) else "Decode") for h in hosts}
    prompts = [_prompt(i) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ip: generate(fleet.target(ip[0] % 2), ip[1], 8),
                             enumerate(prompts)))
    assert all(len(o.token_ids) == 8 for o in outs)
    after = {h: fleet.calls(h, "Prefill" if h in (P1, P2) else "Decode") for h in hosts}
    assert all(after[h] > before[h] for h in hosts), (before, after)

    # Same weights everywhere (one seed): a prompt's greedy answer is the same through either
    # gateway, whichever workers each picked.
    for i in (0, 5):
        assert generate(fleet.target(0), prompts[i], 8).token_ids == outs[i].token_ids
        assert generate(fleet.target(1), prompts[i], 8).token_ids == outs[i].token_ids

    # Four prompts sharing a 4-block prefix: one prefill worker computes them all.
    shared = _prompt(99, 64)
    before = {h: fleet.calls(h, "Prefill") for h in (P1, P2)}
    for i in range(4):
        generate(fleet.target(0), [*shared, *_prompt(200 + i, 8)], 4)
    grew = {h: fleet.calls(h, "Prefill") - before[h] for h in (P1, P2)}
    assert sorted(grew.values()) == [0, 4], grew
    for gateway in fleet.gateways:
        assert gateway.state is not None and gateway.state.router.prefill is not None
        assert gateway.state.router.prefill.num_healthy == 2
        assert gateway.state.router.decode.num_healthy == 2


def test_scale_in_drains_and_scale_out_takes_requests(fleet: Fleet) -> None:
    # Scale-in: D2 leaves DNS and gets SIGTERM while requests run on it.
    prompts = [_prompt(300 + i) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        running = [pool.submit(generate, fleet.target(i % 2), p, 160)
                   for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 30
        while sample(fleet.process_metrics, "splitserve:engine_calls_in_progress") < 1:
            assert time.monotonic() < deadline, "no call reached the worker to drain"
            time.sleep(0.02)
        fleet.dns.set_records({PREFILL: [P1, P2], DECODE: [D1]})
        fleet.process.send_signal(signal.SIGTERM)
        results = [f.result(120) for f in running]
    assert all(len(r.token_ids) == 160 for r in results)  # none failed
    assert fleet.process.wait(30) == 0, fleet.process.stderr.read().decode()[-2000:]
    wait_engines_idle(fleet.loop, list(fleet.workers.values()), 30)  # no lease left behind
    for gateway in fleet.gateways:
        _wait_serving(gateway, 2, 1, 3 * DISCOVERY_S)

    # Scale-out: D3 joins DNS and takes requests within two discovery intervals.
    before = fleet.calls(D3, "Decode")
    fleet.dns.set_records({PREFILL: [P1, P2], DECODE: [D1, D3]})
    joined = time.monotonic()
    for i in range(500, 600):  # distinct prompts: no prefix keeps them on D1
        if fleet.calls(D3, "Decode") > before:
            break
        assert time.monotonic() - joined < 2 * DISCOVERY_S + 2 * POLL_S, "D3 took no request"
        generate(fleet.target(0), _prompt(i), 2)
    for gateway in fleet.gateways:
        _wait_serving(gateway, 2, 2, 2 * DISCOVERY_S + 2 * POLL_S)
