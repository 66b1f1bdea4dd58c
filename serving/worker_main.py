"""`splitserve serve --role {prefill,decode,colocated,gateway}`: start one service.

`colocated` is one process with the same gRPC and REST surface as the whole stack: an engine
worker (prefill + decode in one engine) on an internal loopback port and the gateway in front.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.cli_args import add_engine_args, engine_config_from_args
from kv_transfer import DEFAULT_TCP_STREAMS, MAX_TCP_STREAMS
from protos.auth import AuthConfigError, internal_token_from_env
from protos.tls import tls_from_env
from serving.tracing import setup_tracing

if TYPE_CHECKING:
    from serving.tier_cache import TierConfig

logger = logging.getLogger("splitserve.serve")


KV_TRANSPORTS = ("ipc", "tcp", "shm", "stream")


def _kv_transports(text: str) -> tuple[str, ...]:
    chosen = {t.strip() for t in text.split(",") if t.strip()}
    unknown = chosen - set(KV_TRANSPORTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown KV transport(s) {sorted(unknown)}; choose "
                                         f"from {', '.join(KV_TRANSPORTS)}")
    return tuple(t for t in KV_TRANSPORTS if t in chosen or t == "stream")


def _tcp_streams(text: str) -> int:
    try:
        streams = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kv-tcp-streams takes a number, not {text!r}") from None
    if not 1 <= streams <= MAX_TCP_STREAMS:
        raise argparse.ArgumentTypeError(f"--kv-tcp-streams must be in 1..{MAX_TCP_STREAMS}")
    return streams


def _data_port(text: str) -> int | None:
    if text.strip().lower() == "off":
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--kv-data-port takes a port or 'off', not {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--kv-data-port {port} is outside 0..65535")
    return port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated", "gateway"])
    p.add_argument("--host", default="127.0.0.1", help="bind address of the worker's gRPC port")
    p.add_argument("--port", type=int, default=None,
                   help="gRPC port of a worker (prefill 50061, decode 50062); REST port of "
                        "gateway/colocated (8000)")
    p.add_argument("--advertise", default=None,
                   help="host:port that decode workers use to reach this prefill worker's KV")
    p.add_argument("--log-level", default="info")
    p.add_argument("--kv-transports", type=_kv_transports, default=KV_TRANSPORTS,
                   help="decode role: the ways KV may come from a prefill worker, tried in the "
                        "order ipc (CUDA IPC, same GPU), tcp (the prefill worker's KV data port, "
                        "any host), shm (shared memory, same host), stream (gRPC, anywhere); "
                        f"comma list, stream always included (default: {','.join(KV_TRANSPORTS)})")
    p.add_argument("--kv-tcp-streams", type=_tcp_streams, default=DEFAULT_TCP_STREAMS,
                   help="decode role: connections one pull over the prefill worker's data port "
                        f"opens at once, 1..{MAX_TCP_STREAMS} (default: {DEFAULT_TCP_STREAMS})")
    p.add_argument("--kv-data-port", type=_data_port, default=0,
                   help="prefill role: the port on --host that serves KV blocks raw to decode "
                        "workers (their 'tcp' way; same TLS as the gRPC port); 0 picks a free "
                        "one (default), 'off' serves none")
    tiers = p.add_argument_group("prefix tiers (prefill and colocated roles): GPU -> CPU -> Redis")
    tiers.add_argument("--kv-tier-cpu-mb", type=int, default=0,
                       help="CPU tier of encoded KV blocks, in MiB (0: none)")
    tiers.add_argument("--kv-tier-redis-url", default=None,
                       help="cluster-wide Redis tier, e.g. redis://redis:6379/0 (default: none)")
    tiers.add_argument("--kv-tier-redis-ttl-s", type=int, default=3600,
                       help="expiry of each block in Redis")
    tiers.add_argument("--kv-tier-min-blocks", type=int, default=1,
                       help="fetch from the tiers only when they extend the GPU hit by this "
                            "many blocks")
    add_engine_args(p)
    return p


def tier_config_from_args(args: argparse.Namespace) -> TierConfig:
    """Raises ValueError for a negative size or a min-blocks below 1."""
    from serving.tier_cache import TierConfig  # torch and redis: not for the gateway role

    return TierConfig(cpu_bytes=args.kv_tier_cpu_mb << 20, redis_url=args.kv_tier_redis_url,
                      redis_ttl_s=args.kv_tier_redis_ttl_s,
                      min_blocks=args.kv_tier_min_blocks)


async def _serve_worker(args: argparse.Namespace) -> None:
    from serving.server import run_until_signal, start_worker

    config = engine_config_from_args(args, role=args.role)
    port = args.port if args.port is not None else {"prefill": 50061, "decode": 50062}[args.role]
    handle = await start_worker(config, args.host, port, advertise_address=args.advertise,
                                auth_token=internal_token_from_env(),
                                tiers=tier_config_from_args(args),
                                kv_transports=args.kv_transports,
                                kv_data_port=args.kv_data_port,
                                kv_tcp_streams=args.kv_tcp_streams)
    await run_until_signal(handle.stop, watch=handle.load_task)


async def _serve_colocated(argv: list[str], args: argparse.Namespace) -> None:
    from gateway.config import (
        GatewayConfig,
        chat_settings,
        model_directory,
        sampling_defaults_setting,
        served_model_name_for,
    )
    from gateway.server import GatewayServer
    from serving.server import run_until_signal, start_worker

    config = engine_config_from_args(args, role="colocated")
    token = internal_token_from_env()
    worker = await start_worker(config, "127.0.0.1", 0, auth_token=token,
                                tiers=tier_config_from_args(args))
    assert worker.ready is not None and worker.load_task is not None
    await worker.load_task
    assert worker.aengine is not None
    eng = worker.aengine.engine
    # The in-process gateway asks for the engine's own number of drafts while the worker is
    # lightly loaded (with --speculative-method none the engine ignores it).
    gw_config = GatewayConfig(decode_addresses=(f"127.0.0.1:{worker.port}",), colocated=True,
                              served_model_name=served_model_name_for(args.model,
                                                                      args.served_model_name),
                              tokenizer_path=eng.tokenizer_source or "",
                              max_model_len=eng.max_model_len, max_prompt_tokens=eng.max_model_len,
                              internal_token=token,
                              speculative_tokens=config.speculative.num_speculative_tokens,
                              speculative_max_load=args.speculative_max_load,
                              speculative_draft_max_load=args.speculative_draft_max_load,
                              api_key=args.api_key, ssl_certfile=args.ssl_certfile,
                              ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                              **chat_settings(args),
                              **sampling_defaults_setting(args,
                                                          model_directory(config.load.model)))
    gw = GatewayServer(gw_config, rest_host=args.gateway_host, rest_port=args.port or 8000,
                       grpc_host=args.gateway_host, grpc_port=args.grpc_port)
    await gw.start()
    scheme = "https" if gw_config.tls else "http"
    print(f"splitserve colocated: REST {scheme}://{args.gateway_host}:{gw.rest_port}/v1 "
          f"gRPC {args.gateway_host}:{gw.grpc_port}", flush=True)

    async def stop() -> None:
        await gw.stop()
        await worker.stop()

    await run_until_signal(stop)


def _gateway_default(name: str) -> Any:
    from gateway.config import GatewayConfig  # torch-free, like the gateway role

    return GatewayConfig.__dataclass_fields__[name].default


def build_serve_parser() -> argparse.ArgumentParser:
    """`build_parser` plus the flags of the colocated role's in-process gateway."""
    from gateway.config import add_chat_args, add_public_security_args  # torch-free

    parser = build_parser()
    parser.add_argument("--grpc-port", type=int, default=50050,
                        help="gateway/colocated: public gRPC port")
    parser.add_argument("--gateway-host", default="127.0.0.1",
                        help="colocated: bind address of the REST and gRPC ports")
    parser.add_argument("--served-model-name", default=None,
                        help="colocated: the model's name in the API (default: --model as "
                             "given, or the embedded SmolLM2's name)")
    add_public_security_args(parser, role="colocated")
    add_chat_args(parser, role="colocated")
    parser.add_argument("--speculative-draft-max-load", type=int, default=_gateway_default(
                            "speculative_draft_max_load"),
                        help="colocated: requests pending on the worker from which its draft "
                             "model gives way to n-gram lookup")
    parser.add_argument("--speculative-max-load", type=int, default=_gateway_default(
                            "speculative_max_load"),
                        help="colocated: requests pending on the worker from which the gateway "
                             "turns speculative decoding off (with --speculative-method)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv or [])
    parser = build_serve_parser()
    if "--role" in argv and argv[argv.index("--role") + 1 : argv.index("--role") + 2] == ["gateway"]:
        from gateway.server import main as gateway_main

        rest = [a for i, a in enumerate(argv) if a != "--role" and (i == 0 or argv[i - 1] != "--role")]
        return gateway_main(rest)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing(f"splitserve-{args.role}")  # a no-op unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        tls_from_env()  # a broken TLS set-up fails now, not after the model loaded
        if args.role == "colocated":
            from gateway.config import chat_settings, model_directory, sampling_defaults_setting

            chat_settings(args)  # a bad --chat-template fails now, not after the model loaded
            sampling_defaults_setting(args, model_directory(args.model))  # ... or generation config
            asyncio.run(_serve_colocated(argv, args))
        else:
            asyncio.run(_serve_worker(args))
    except RuntimeError as e:
        logger.error("%s: %s", e, e.__cause__)
        return 1
    except AuthConfigError as e:  # the message names the variable
        logger.error("%s", e)
        return 2
    except ValueError as e:  # a bad option value (e.g. --kv-tier-min-blocks 0), TLS files
        logger.error("%s", e)
        return 2
    return 0
