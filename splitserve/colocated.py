"""`splitserve serve --role colocated`: one process with the same gRPC and REST surface as the
whole stack: a decode-service worker in the colocated role (prefill + decode in one engine) on an
internal loopback port, and the gateway in front of it."""

from __future__ import annotations

import argparse
from typing import Any

from engine.cli_args import engine_config_from_args
from rpc.auth import internal_token_from_env
from worker.cli_args import tier_config_from_args


def _gateway_default(name: str) -> Any:
    from gateway.config import GatewayConfig  # torch-free, like the gateway role

    return GatewayConfig.__dataclass_fields__[name].default


def add_colocated_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the colocated role's in-process gateway."""
    from gateway.config import (  # torch-free
        add_chat_args,
        add_public_security_args,
        add_serving_log_args,
    )

    parser.add_argument("--grpc-port", type=int, default=50050,
                        help="gateway/colocated: public gRPC port")
    parser.add_argument("--gateway-host", default=None,
                        help="colocated: the older name of --host (bind address of the REST "
                             "and gRPC ports)")
    add_public_security_args(parser, role="colocated")
    add_chat_args(parser, role="colocated")
    add_serving_log_args(parser, role="colocated")
    parser.add_argument("--speculative-draft-max-load", type=int, default=_gateway_default(
                            "speculative_draft_max_load"),
                        help="colocated: requests pending on the worker from which its draft "
                             "model gives way to n-gram lookup")
    parser.add_argument("--speculative-max-load", type=int, default=_gateway_default(
                            "speculative_max_load"),
                        help="colocated: requests pending on the worker from which the gateway "
                             "turns speculative decoding off (with --speculative-method)")


def precheck(args: argparse.Namespace) -> None:
    """A bad --chat-template or generation config fails now, not after the model loaded."""
    from gateway.config import chat_settings, model_directory, sampling_defaults_setting

    chat_settings(args)
    sampling_defaults_setting(args, model_directory(args.model))


async def serve(args: argparse.Namespace) -> None:
    from decode_service.server import start_decode_worker
    from gateway.config import (
        GatewayConfig,
        chat_settings,
        model_directory,
        sampling_defaults_setting,
        served_model_name_for,
    )
    from gateway.server import GatewayServer
    from worker.server import run_until_signal

    config = engine_config_from_args(args, role="colocated")
    token = internal_token_from_env()
    worker = await start_decode_worker(config, "127.0.0.1", 0, auth_token=token,
                                       tiers=tier_config_from_args(args))
    assert worker.load_task is not None
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
                              api_key=args.api_key, log_requests=args.log_requests,
                              uvicorn_log_level=args.uvicorn_log_level,
                              ssl_certfile=args.ssl_certfile,
                              ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                              **chat_settings(args),
                              **sampling_defaults_setting(args,
                                                          model_directory(config.load.model)))
    host = args.gateway_host or args.host
    gw = GatewayServer(gw_config, rest_host=host, rest_port=args.port or 8000,
                       grpc_port=args.grpc_port)
    await gw.start()
    scheme = "https" if gw_config.tls else "http"
    print(f"splitserve colocated: REST {scheme}://{host}:{gw.rest_port}/v1 "
          f"gRPC {host}:{gw.grpc_port}", flush=True)

    async def stop() -> None:
        await gw.stop()
        await worker.stop()

    await run_until_signal(stop)
