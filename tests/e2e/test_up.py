"""`splitserve up` starts gateway + prefill + decode, serves, and stops every child on SIGTERM —
even when the signal arrives twice (a `timeout` or process manager signals the whole group)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine_api.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _alive(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", "--", marker], capture_output=True, text=True)
    return [p for p in out.stdout.split() if p and int(p) != os.getpid()]


PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


def complete_greedy(rest_port: int, max_tokens: int = 4) -> dict[str, Any]:
    """A greedy completion of PROMPT_IDS from the stack's REST API."""
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": PROMPT_IDS,
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{rest_port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def _spawned_children(pid: str) -> list[str]:
    """`pid`'s children started by multiprocessing's spawn (not its resource tracker)."""
    out = subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True)
    return [c for c in out.stdout.split()
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.timeout(400)
def test_up_serves_and_stops_all_children(tmp_path: Path, smollm2: LLM) -> None:
    """The stack with the prefill worker's model split over three processes (tensor
    parallelism: SmolLM2's 9 heads, 3 KV heads, 1,536 MLP columns) and the decode worker's
    whole, the prompt's KV handed from the three ranks to the one process: greedy tokens equal
    the one-process engine's, and every process — the prefill worker's ranks too — is gone
    after SIGTERM."""
    rest, grpc_port, prefill, decode = _free_ports(4)
    cmd = [sys.executable, "-m", "splitserve", "up", "--port", str(rest), "--grpc-port",
           str(grpc_port), "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--log-dir", str(tmp_path / "logs"), "--max-model-len", "1024",
           "--prefill-tensor-parallel-size", "3", "--cpu-threads", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    marker = f"--port {prefill}"  # unique to this test's prefill worker
    try:
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "ready" in line or time.monotonic() > deadline:
                break
        assert any("ready" in ln for ln in lines), "".join(lines)
        got = complete_greedy(rest, max_tokens=8)
        want = smollm2.generate([{"prompt_token_ids": PROMPT_IDS}],
                                SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
        assert got["choices"][0]["text"] == want.text
        assert got["usage"]["completion_tokens"] == len(want.token_ids)
        workers = _alive(marker)
        assert workers, "the prefill worker should be running"
        ranks = [c for pid in workers for c in _spawned_children(pid)]
        assert len(ranks) == 2, f"the prefill worker's ranks 1 and 2: {ranks}"
        decode_workers = _alive(f"--port {decode}")
        assert decode_workers and not [c for pid in decode_workers
                                       for c in _spawned_children(pid)], "decode: one process"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the repeat must not abort the orderly stop
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(marker), "a worker outlived `splitserve up`"
        assert not [r for r in ranks if Path(f"/proc/{r}").exists()], "a rank outlived its worker"
        for name in ("prefill", "decode", "gateway"):
            assert (tmp_path / "logs" / f"{name}.log").stat().st_size > 0
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(marker):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.parametrize(("argv", "tokenizer_source", "name"), [
    ([], None, "SmolLM2-135M-Instruct"),
    (["--model", "dummy:llama-3.1-8b", "--tokenizer", "/t/tokenizer.json"], "/t/tokenizer.json",
     "dummy:llama-3.1-8b"),
    (["--model", "/m/Llama-3.1-8B", "--served-model-name", "llama"], "/m/Llama-3.1-8B", "llama"),
])
def test_the_served_model_name_follows_the_model_not_the_tokenizer(
        argv: list[str], tokenizer_source: str | None, name: str) -> None:
    """As in vLLM: the API names the model by --served-model-name, else by --model as given
    (the gateway of `splitserve up` gets the tokenizer as its --model, so it must be told)."""
    from gateway.config import served_model_name_for
    from gateway.server import build_parser as gateway_parser
    from gateway.server import config_from_args
    from splitserve.serve import build_serve_parser
    from splitserve.up import build_parser, service_argv

    args, engine_args = build_parser().parse_known_args(argv)
    gw_argv = service_argv(args, engine_args)["gateway"]
    assert gw_argv[:2] == ["--role", "gateway"]  # `splitserve serve` hands the rest on
    gw = config_from_args(gateway_parser().parse_args(gw_argv[2:]))
    assert gw.served_model_name == name
    assert gw.tokenizer_path == (tokenizer_source or "")
    colocated = build_serve_parser().parse_args(["--role", "colocated", *argv])
    assert served_model_name_for(colocated.model, colocated.served_model_name) == name


def test_kv_transports_flag_orders_and_always_keeps_the_stream() -> None:
    from splitserve.serve import build_serve_parser

    parse = build_serve_parser().parse_args
    assert parse(["--role", "decode"]).kv_transports == ("ipc", "tcp", "shm", "stream")
    assert parse(["--role", "decode", "--kv-transports", "shm"]).kv_transports == (
        "shm", "stream")
    assert parse(["--role", "decode", "--kv-transports", "shm,stream,tcp,ipc"]).kv_transports == (
        "ipc", "tcp", "shm", "stream")
    with pytest.raises(SystemExit):
        parse(["--role", "decode", "--kv-transports", "rdma"])


def test_kv_tcp_streams_flag_is_bounded() -> None:
    from kv_transfer import DEFAULT_TCP_STREAMS, MAX_TCP_STREAMS
    from splitserve.serve import build_serve_parser

    parse = build_serve_parser().parse_args
    assert parse(["--role", "decode"]).kv_tcp_streams == DEFAULT_TCP_STREAMS
    assert parse(["--role", "decode", "--kv-tcp-streams", "1"]).kv_tcp_streams == 1
    for bad in ("0", str(MAX_TCP_STREAMS + 1), "many"):
        with pytest.raises(SystemExit):
            parse(["--role", "decode", "--kv-tcp-streams", bad])


def test_kv_data_port_flag_takes_a_port_or_off() -> None:
    from splitserve.serve import build_serve_parser

    parse = build_serve_parser().parse_args
    assert parse(["--role", "prefill"]).kv_data_port == 0  # a free port, learnt per pull
    assert parse(["--role", "prefill", "--kv-data-port", "50071"]).kv_data_port == 50071
    assert parse(["--role", "prefill", "--kv-data-port", "OFF"]).kv_data_port is None
    for bad in ("-1", "70000", "fast"):
        with pytest.raises(SystemExit):
            parse(["--role", "prefill", "--kv-data-port", bad])


@pytest.mark.parametrize(("argv", "prefill_tp", "decode_tp"), [
    ([], None, None),
    (["-tp", "2"], "2", "2"),
    (["--tensor-parallel-size=2", "--decode-tensor-parallel-size", "1"], "2", "1"),
    (["--prefill-tensor-parallel-size", "4", "--tensor-parallel-size", "2"], "4", "2"),
])
def test_each_role_may_split_its_model_differently(argv: list[str], prefill_tp: str | None,
                                                   decode_tp: str | None) -> None:
    from splitserve.serve import build_serve_parser
    from splitserve.up import build_parser, service_argv

    args, engine_args = build_parser().parse_known_args(argv)
    services = service_argv(args, engine_args)
    for role, want in (("prefill", prefill_tp), ("decode", decode_tp)):
        parsed = build_serve_parser().parse_args(services[role])
        assert parsed.tensor_parallel_size == int(want or 1), (role, services[role])


def test_up_gives_load_bounds_to_the_right_services() -> None:
    """`--max-concurrent-requests` is the gateway's (not an engine flag the workers would
    refuse); `--max-queued-requests` and `--scheduling-policy` reach both workers."""
    from splitserve.up import build_parser, service_argv

    args, engine_args = build_parser().parse_known_args(
        ["--max-concurrent-requests", "7", "--max-queued-requests", "3",
         "--scheduling-policy", "priority"])
    argv = service_argv(args, engine_args)
    gw = argv["gateway"]
    assert gw[gw.index("--max-concurrent-requests") + 1] == "7"
    for role in ("prefill", "decode"):
        assert "--max-concurrent-requests" not in argv[role]
        assert argv[role][argv[role].index("--max-queued-requests") + 1] == "3"
        assert argv[role][argv[role].index("--scheduling-policy") + 1] == "priority"
    assert "--max-queued-requests" not in gw
    from splitserve.serve import build_serve_parser

    colocated = build_serve_parser().parse_args(
        ["--role", "colocated", "--max-concurrent-requests", "5"])
    assert colocated.max_concurrent_requests == 5  # its in-process gateway's bound


def test_up_gives_runtime_lora_flags_to_the_right_services() -> None:
    """`--allow-runtime-lora-updating` is the gateway's; `--max-loras` (adapter slots) reaches
    both workers; the colocated role's in-process gateway takes the gateway's flag."""
    from gateway.server import build_parser as gateway_parser
    from gateway.server import config_from_args
    from splitserve.serve import build_serve_parser
    from splitserve.up import build_parser, service_argv

    args, engine_args = build_parser().parse_known_args(
        ["--allow-runtime-lora-updating", "--max-loras", "2", "--lora-resolver-dir", "/tmp"])
    argv = service_argv(args, engine_args)
    gateway = config_from_args(gateway_parser().parse_args(argv["gateway"][2:]))
    assert gateway.allow_runtime_lora_updating and gateway.lora_resolver_dir == "/tmp"
    for role in ("prefill", "decode"):
        assert "--allow-runtime-lora-updating" not in argv[role]
        assert "--lora-resolver-dir" not in argv[role]
        assert build_serve_parser().parse_args(argv[role]).max_loras == 2
    default, _ = build_parser().parse_known_args([])
    gw = service_argv(default, [])["gateway"]
    assert not config_from_args(gateway_parser().parse_args(gw[2:])).allow_runtime_lora_updating
    colocated = build_serve_parser().parse_args(
        ["--role", "colocated", "--allow-runtime-lora-updating"])
    assert colocated.allow_runtime_lora_updating
