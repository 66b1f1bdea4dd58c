"""`splitserve up`: gateway + 1 prefill + 1 decode worker as processes on this machine.

Waits until every service reports healthy, prints where to send requests, keeps a log per
service under --log-dir, and on Ctrl-C / SIGTERM stops them all (gateway first, so in-flight
requests drain, then the workers). The workers take only calls that carry the stack's secret
(rpc/auth.py): SPLITSERVE_INTERNAL_TOKEN if set, else a random one made here and handed to
the three processes in their environment.

Engine flags (see `splitserve serve --help`) go to both workers, e.g. `--speculative-method
ngram --num-speculative-tokens 4` for speculative decoding on the decode worker, or
`--speculative-method draft_model --speculative-model PATH` for a draft model (a prefill worker
never speculates, and loads no draft). The gateway then asks for that many drafts while the decode worker is
lightly loaded (`--speculative-tokens`, `--speculative-max-load` override its policy).
`--max-loras N --allow-runtime-lora-updating` lets adapters be loaded and unloaded while the
stack runs (POST /v1/load_lora_adapter, /v1/unload_lora_adapter on the gateway);
`--max-loras N --lora-resolver-dir DIR` loads the adapter DIR/<model> a request names on first
use.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from engine_api.cpus import available_cpus
from gateway.config import API_KEY_ENV, add_serving_log_args, served_model_name_for
from rpc.auth import INTERNAL_TOKEN_ENV, AuthConfigError, internal_token_from_env
from rpc.tls import TlsConfigError, tls_from_env
from splitserve.supervise import (
    death_report,
    grpc_healthy,
    http_healthy,
    ports_in_use,
    spawn,
)
from worker.cli_args import add_worker_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve up", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="bind address of the gateway")
    p.add_argument("--port", type=int, default=8000, help="REST port of the gateway")
    p.add_argument("--grpc-port", type=int, default=50050, help="gRPC port of the gateway")
    p.add_argument("--prefill-port", type=int, default=50061)
    p.add_argument("--decode-port", type=int, default=50062)
    p.add_argument("--log-dir", default="logs")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"the gateway's API key (default: ${API_KEY_ENV}, which keeps it out "
                        "of `ps`)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given, or the "
                        "embedded SmolLM2's name)")
    p.add_argument("--speculative-tokens", type=int, default=None,
                   help="gateway: speculative drafts per step asked of a lightly loaded decode "
                        "worker (default: the workers' --num-speculative-tokens if given, else "
                        "the gateway's default)")
    p.add_argument("--speculative-max-load", type=int, default=None,
                   help="gateway: pending requests on the decode worker from which speculation "
                        "is off")
    p.add_argument("--speculative-draft-max-load", type=int, default=None,
                   help="gateway: pending requests on the decode worker from which its draft "
                        "model gives way to n-gram lookup")
    p.add_argument("--chat-template", default=None,
                   help="gateway: a Jinja2 chat template file used in place of the model's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="gateway: accept a request's own chat_template (code the server runs)")
    p.add_argument("--tool-call-parser", default=None,
                   help="gateway: parse tool calls out of the output (hermes, llama3_json), "
                        "enabling tool_choice \"auto\"")
    p.add_argument("--reasoning-parser", default=None,
                   help="gateway: split <think> text off chat answers into `reasoning` "
                        "(deepseek_r1, qwen3)")
    p.add_argument("--responses-store-max-entries", type=int, default=None,
                   help="gateway: stored Responses API responses kept at most (0: none stored)")
    p.add_argument("--responses-store-max-bytes", type=int, default=None,
                   help="gateway: bytes of stored Responses API responses kept at most")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="gateway: requests in flight at most; more are refused with 429 "
                        "(default: no bound; the workers' own is --max-queued-requests)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="gateway: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(give the workers adapter slots with --max-loras N)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="gateway: sampling defaults for requests that leave them unset (auto: "
                        "the model's generation_config.json; vllm: none; or a directory's)")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="gateway: sampling defaults over the generation config's")
    p.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                   help="gateway: load an adapter a request names from DIR/<name> on first use "
                        "(give the workers adapter slots with --max-loras N)")
    add_serving_log_args(p, role="gateway")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                       help=f"the {role} worker's tensor-parallel size, over the engine flags' "
                            "--tensor-parallel-size (KV blocks travel whole, so the two roles "
                            "may split differently)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--exit-after-ready", action="store_true",
                   help="stop everything once healthy (smoke test)")
    return p


def _check_engine_args(engine_args: list[str]) -> None:
    """The flags `up` hands to both workers must be worker flags: a typo (`--prot 37300`) is
    refused here, with argparse's message, instead of killing both workers at start-up."""
    p = argparse.ArgumentParser(prog="splitserve up", add_help=False, allow_abbrev=False)
    add_worker_args(p)
    p.parse_args(engine_args)


def _wait_until_ready(procs: dict[str, subprocess.Popen[bytes]], checks: dict[str, Callable[[], bool]],
                      log_dir: Path, timeout_s: float) -> bool:
    """Poll every service's health, saying which ones are still awaited whenever that changes;
    False (after printing why) once a child died or the time is up."""
    deadline = time.monotonic() + timeout_s
    pending = list(checks)
    said: list[str] = []
    while pending:
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            for name in dead:
                print(death_report(name, procs[name], log_dir), file=sys.stderr)
            return False
        if time.monotonic() > deadline:
            print(f"splitserve: start-up timed out after {timeout_s:.0f} s waiting for "
                  f"{', '.join(pending)}; logs in {log_dir}/", file=sys.stderr)
            return False
        pending = [n for n in pending if not checks[n]()]
        if pending and pending != said:
            what = {"prefill": "prefill (loading the model)", "decode": "decode (loading the model)",
                    "gateway": "gateway"}
            print(f"splitserve: waiting for {', '.join(what.get(n, n) for n in pending)}...",
                  flush=True)
            said = pending
        if pending:
            time.sleep(0.5)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args, engine_args = build_parser().parse_known_args(argv)
    _check_engine_args(engine_args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def stop_all() -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        # A second signal must not interrupt the orderly stop below.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name in ("gateway", "decode", "prefill"):
            p = procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()

    def on_signal(*_: object) -> None:
        # Ignore repeats at once: a second signal must not interrupt the orderly stop (a
        # `timeout` or a process manager often sends SIGTERM to the whole group).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if "--cpu-threads" not in engine_args:
        # Two engines share this machine: on the CPU each gets half of the cores.
        # (available_cpus: the affinity mask capped by a cgroup quota, not the host's cores.)
        engine_args = [*engine_args, "--cpu-threads", str(max(1, available_cpus() // 2))]
    try:
        token = internal_token_from_env() or secrets.token_urlsafe(32)
    except AuthConfigError as e:
        print(f"splitserve: {INTERNAL_TOKEN_ENV}: {e}", file=sys.stderr)
        return 2
    try:
        tls_from_env()  # the three services read the same variables
    except TlsConfigError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        return 2
    # Another server on one of these ports would answer the health checks below (a "ready"
    # that is not this stack's) or take half of its traffic: refuse to start beside it.
    taken = (ports_in_use(args.host, (args.port, args.grpc_port))
             + ports_in_use("127.0.0.1", (args.prefill_port, args.decode_port)))
    if taken:
        print(f"splitserve: port(s) {', '.join(map(str, taken))} already in use (another "
              "splitserve?); stop it or choose other ports (--port, --grpc-port, "
              "--prefill-port, --decode-port)", file=sys.stderr)
        return 1
    prefill_addr = f"127.0.0.1:{args.prefill_port}"
    decode_addr = f"127.0.0.1:{args.decode_port}"
    # The API key goes to the gateway in its environment, not on its command line (`ps`).
    gateway_env = {API_KEY_ENV: args.api_key} if args.api_key else {}
    try:
        print(f"splitserve: starting (logs in {log_dir}/)...", flush=True)
        for name, service_args in service_argv(args, engine_args).items():
            procs[name] = spawn(name, service_args, log_dir, token,
                                gateway_env if name == "gateway" else None)
        health = f"http://{_dial_host(args.host)}:{args.port}/health"
        checks: dict[str, Callable[[], bool]] = {
            "prefill": lambda: grpc_healthy(prefill_addr),
            "decode": lambda: grpc_healthy(decode_addr),
            "gateway": lambda: http_healthy(health, serving_mode="disaggregated")}
        if not _wait_until_ready(procs, checks, log_dir, args.startup_timeout):
            return 1
        host = "localhost" if args.host in ("127.0.0.1", "0.0.0.0") else args.host
        print(f"splitserve: ready\n  REST (OpenAI-compatible): http://{host}:{args.port}/v1\n"
              f"  gRPC Gateway.Generate:    {host}:{args.grpc_port}\n"
              f"  prefill worker {prefill_addr}, decode worker {decode_addr}\n"
              "  Ctrl-C stops everything.", flush=True)
        if args.exit_after_ready:
            return 0
        while True:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                for name in dead:
                    print(death_report(name, procs[name], log_dir), file=sys.stderr)
                print("splitserve: stopping", file=sys.stderr)
                return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all()


def _dial_host(bind_host: str) -> str:
    """Where this machine reaches a port bound on `bind_host`."""
    if bind_host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind_host == "::":
        return "[::1]"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def service_argv(args: argparse.Namespace, engine_args: list[str]) -> dict[str, list[str]]:
    """The `splitserve serve` arguments of each service, in start order (prefill, decode,
    gateway)."""
    prefill_addr = f"127.0.0.1:{args.prefill_port}"
    decode_addr = f"127.0.0.1:{args.decode_port}"
    gw = ["--role", "gateway", "--prefill", prefill_addr, "--decode", decode_addr,
          "--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port)]
    model = _flag(engine_args, "--model")
    if model:
        gw += ["--model", _flag(engine_args, "--tokenizer") or model]
    # Named after the model, not after the tokenizer the gateway loads.
    gw += ["--served-model-name", served_model_name_for(model, args.served_model_name)]
    if args.log_requests:
        gw += ["--enable-log-requests"]
    gw += ["--uvicorn-log-level", args.uvicorn_log_level]
    otlp = _flag(engine_args, "--otlp-traces-endpoint")  # the workers' flag, for all three
    if otlp:
        gw += ["--otlp-traces-endpoint", otlp]
    max_len = _flag(engine_args, "--max-model-len")
    if max_len:
        gw += ["--max-model-len", max_len]
    # Ask for the decode worker's own number of drafts unless told otherwise: the gateway's
    # default could be below it (wasted capability) or above it (capped by the worker anyway).
    spec_tokens = (str(args.speculative_tokens) if args.speculative_tokens is not None
                   else _flag(engine_args, "--num-speculative-tokens"))
    if spec_tokens is not None:
        gw += ["--speculative-tokens", spec_tokens]
    if args.speculative_max_load is not None:
        gw += ["--speculative-max-load", str(args.speculative_max_load)]
    if args.speculative_draft_max_load is not None:
        gw += ["--speculative-draft-max-load", str(args.speculative_draft_max_load)]
    if args.chat_template:
        gw += ["--chat-template", str(Path(args.chat_template).resolve())]
    if args.trust_request_chat_template:
        gw += ["--trust-request-chat-template"]
    if args.tool_call_parser:
        gw += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        gw += ["--reasoning-parser", args.reasoning_parser]
    if args.allow_runtime_lora_updating:
        gw += ["--allow-runtime-lora-updating"]
    if args.lora_resolver_dir:
        gw += ["--lora-resolver-dir", args.lora_resolver_dir]
    generation = args.generation_config
    if generation == "auto" and model and os.path.isdir(model):
        generation = str(Path(model).resolve())  # the model's file, whichever tokenizer
    if generation != "auto":
        gw += ["--generation-config", generation]
    if args.override_generation_config:
        gw += ["--override-generation-config", args.override_generation_config]
    for flag in ("responses_store_max_entries", "responses_store_max_bytes",
                 "max_concurrent_requests"):
        if getattr(args, flag) is not None:
            gw += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return {"prefill": ["--role", "prefill", "--port", str(args.prefill_port),
                        *_role_engine_args(engine_args, args.prefill_tensor_parallel_size)],
            "decode": ["--role", "decode", "--port", str(args.decode_port),
                       "--kv-peers", f"127.0.0.1:{args.prefill_port}",
                       *_role_engine_args(engine_args, args.decode_tensor_parallel_size)],
            "gateway": gw}


_TP_FLAGS = ("--tensor-parallel-size", "-tp")


def _role_engine_args(engine_args: list[str], tp_size: int | None) -> list[str]:
    """The engine flags with a role's own tensor-parallel size in place of the shared one."""
    if tp_size is None:
        return list(engine_args)
    out: list[str] = []
    skip = False
    for a in engine_args:
        if skip:
            skip = False
            continue
        if a in _TP_FLAGS:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in _TP_FLAGS):
            continue
        out.append(a)
    return [*out, "--tensor-parallel-size", str(tp_size)]


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
