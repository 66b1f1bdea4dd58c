"""Run the gateway: uvicorn (REST) and grpc.aio (gRPC) in one asyncio loop, plus the CLI.

    python -m gateway --prefill 10.0.0.1:50051 --decode 10.0.0.2:50052,10.0.0.3:50052
    python -m gateway --colocated --decode 127.0.0.1:50052 --port 8000 --grpc-port 50050
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import ssl
from collections.abc import Iterator, Sequence

import uvicorn

from engine_api.errors import ModelLoadError
from gateway.config import (
    SPEC_POLICIES,
    SPEC_POLICY_METHODS,
    GatewayConfig,
    GatewayConfigError,
    add_chat_args,
    add_public_security_args,
    add_serving_log_args,
    chat_settings,
    model_directory,
    sampling_defaults_setting,
    served_model_name_for,
)
from gateway.grpc_server import GrpcFrontend
from gateway.lora_admin import watch_workers
from gateway.openai_api import build_app
from gateway.state import GatewayState
from gateway.tokenization import TokenizerLike, load_tokenizer
from rpc.auth import AuthConfigError, internal_token_from_env
from rpc.tls import TlsConfigError, tls_from_env
from rpc.tracing import setup_tracing

log = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `serve_gateway` owns SIGINT/SIGTERM so that
    REST and gRPC drain together (uvicorn would otherwise re-raise the signal on exit)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """One running gateway. `start()` binds both ports (0 = ephemeral); `stop()` drains.

    After `start()`, `rest_port` and `grpc_port` hold the bound ports.
    """

    def __init__(self, config: GatewayConfig, *, rest_host: str = "127.0.0.1", rest_port: int = 8000,
                 grpc_host: str | None = None, grpc_port: int = 50050,
                 tokenizer: TokenizerLike | None = None) -> None:
        """Both ports bind `rest_host` (loopback unless told) unless `grpc_host` says
        otherwise: one bind setting, so REST and gRPC are exposed alike."""
        self.config = config
        self._tokenizer = tokenizer
        self._rest_addr = (rest_host, rest_port)
        self._grpc_addr = (rest_host if grpc_host is None else grpc_host, grpc_port)
        self.rest_port = 0
        self.grpc_port = 0
        self.state: GatewayState | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self._grpc: GrpcFrontend | None = None

    async def start(self) -> None:
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(load_tokenizer, self.config.tokenizer_path)
        state = self.state = GatewayState.build(self.config, tokenizer)
        watch_workers(state)  # runtime LoRA adapters put back on restarted workers
        self._grpc = GrpcFrontend(state, *self._grpc_addr)
        self.grpc_port = self._grpc.port
        await state.router.start()
        await self._grpc.start()
        sock = socket.socket(socket.AF_INET6 if ":" in self._rest_addr[0] else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._rest_addr)
        self.rest_port = sock.getsockname()[1]
        cfg = self.config
        uv_config = uvicorn.Config(
            build_app(state), log_level=cfg.uvicorn_log_level, lifespan="off",
            timeout_graceful_shutdown=int(cfg.shutdown_grace_s) or 1,
            ssl_certfile=cfg.ssl_certfile, ssl_keyfile=cfg.ssl_keyfile,
            ssl_ca_certs=cfg.ssl_ca_certs,
            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.ssl_ca_certs else ssl.CERT_NONE)
        self._uvicorn = _EmbeddedUvicorn(uv_config)
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._uvicorn_task.done():
                self._uvicorn_task.result()
                raise RuntimeError("uvicorn exited during start-up")
            await asyncio.sleep(0.01)
        log.info("gateway serving REST on :%d, gRPC on :%d%s", self.rest_port, self.grpc_port,
                 " over TLS" + (" (client certificates required)" if cfg.ssl_ca_certs else "")
                 if cfg.tls else "")

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish for up to `shutdown_grace_s`."""
        if self.state is not None:
            self.state.draining = True
        grace = self.config.shutdown_grace_s
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._uvicorn_task
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.state is not None:
            await self.state.orchestrator.drain_background()
            task = self.state.reconcile_task
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.state.router.close()


async def serve_gateway(config: GatewayConfig, rest_host: str, rest_port: int, grpc_port: int,
                        stop: asyncio.Event | None = None) -> None:
    """Serve REST and gRPC until SIGINT/SIGTERM (or `stop` is set), then drain and exit."""
    server = GatewayServer(config, rest_host=rest_host, rest_port=rest_port, grpc_port=grpc_port)
    await server.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


# -- CLI --------------------------------------------------------------------------------------
def _addresses(values: Sequence[str] | None) -> tuple[str, ...]:
    """Repeatable flags whose values may also be comma lists."""
    return tuple(a.strip() for v in values or () for a in v.split(",") if a.strip())


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", action="append",
                   help="prefill workers: host:port or dns:[//DNS_SERVER/]NAME:PORT (every "
                        "address of NAME) (repeatable, or comma list)")
    p.add_argument("--decode", action="append",
                   help="decode workers: host:port or dns:[//DNS_SERVER/]NAME:PORT (repeatable, "
                        "or comma list)")
    p.add_argument("--discovery-interval", type=float, default=d["discovery_interval_s"].default,
                   help="seconds between lookups of dns: targets (sooner when their TTL is "
                        "shorter)")
    p.add_argument("--colocated", action="store_true",
                   help="no prefill pool: decode workers compute the prompt themselves")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address of the REST and gRPC ports (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=50050, help="gRPC port")
    p.add_argument("--model", default="", help="tokenizer source: .gguf, tokenizer.json or HF dir "
                                               "(default: the embedded SmolLM2 GGUF)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given, or the "
                        "embedded SmolLM2's name)")
    add_public_security_args(p)
    add_chat_args(p)
    add_serving_log_args(p)
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export traces over OTLP to URL (default: $OTEL_EXPORTER_OTLP_ENDPOINT "
                        "if set; needs the otlp extra)")
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"].default)
    p.add_argument("--max-tokens-cap", type=int, default=d["max_tokens_cap"].default)
    p.add_argument("--request-timeout", type=float, default=d["request_timeout_s"].default)
    p.add_argument("--kv-failure-policy", choices=("recompute", "fail"),
                   default=d["kv_failure_policy"].default)
    p.add_argument("--speculative-tokens", type=int, default=d["speculative_tokens"].default,
                   help="speculative drafts per step asked of a lightly loaded decode worker "
                        "(0: never ask; workers without --speculative-method ignore it)")
    p.add_argument("--speculative-max-load", type=int,
                   default=d["speculative_max_load"].default,
                   help="pending requests on a decode worker from which speculation is off")
    p.add_argument("--speculative-draft-max-load", type=int,
                   default=d["speculative_draft_max_load"].default,
                   help="pending requests on a decode worker from which its draft model gives "
                        "way to n-gram lookup (0: never the draft model)")
    p.add_argument("--speculative-policy", choices=SPEC_POLICIES,
                   default=d["speculative_policy"].default,
                   help="adaptive: method and drafts from the worker's measured step cost and "
                        "acceptance; threshold: drafts below --speculative-max-load; always: "
                        "--speculative-tokens drafts at any load")
    p.add_argument("--speculative-policy-method", choices=SPEC_POLICY_METHODS,
                   default=d["speculative_policy_method"].default,
                   help="the proposer the policy asks for (auto: any the worker has)")
    p.add_argument("--speculative-tpot-slo-ms", type=float,
                   default=d["speculative_tpot_slo_ms"].default,
                   help="adaptive policy: no drafts whose predicted step time exceeds this "
                        "(0: no guard)")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        prefill_addresses=_addresses(args.prefill), decode_addresses=_addresses(args.decode),
        colocated=args.colocated, discovery_interval_s=args.discovery_interval,
        served_model_name=served_model_name_for(args.model, args.served_model_name),
        tokenizer_path=args.model, max_model_len=args.max_model_len, api_key=args.api_key,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        max_prompt_tokens=args.max_model_len, max_tokens_cap=args.max_tokens_cap,
        request_timeout_s=args.request_timeout, kv_failure_policy=args.kv_failure_policy,
        speculative_tokens=args.speculative_tokens,
        speculative_max_load=args.speculative_max_load,
        speculative_draft_max_load=args.speculative_draft_max_load,
        speculative_policy=args.speculative_policy,
        speculative_policy_method=args.speculative_policy_method,
        speculative_tpot_slo_ms=args.speculative_tpot_slo_ms,
        internal_token=internal_token_from_env(), log_requests=args.log_requests,
        uvicorn_log_level=args.uvicorn_log_level, **chat_settings(args),
        **sampling_defaults_setting(args, model_directory(args.model)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        tls_from_env()  # the channels to the workers use it
    except (GatewayConfigError, AuthConfigError, TlsConfigError) as err:
        parser.error(str(err))
    setup_tracing("splitserve-gateway", endpoint=args.otlp_traces_endpoint)  # no-op if none set
    try:
        asyncio.run(serve_gateway(config, args.host, args.port, args.grpc_port))
    except (OSError, ModelLoadError) as err:  # a port in use, a missing tokenizer: one line
        log.error("%s", err)
        return 1
    return 0
