"""`splitserve serve --role decode` (or `python -m decode_service`): one decode worker."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.cli_args import engine_config_from_args
from rpc.auth import internal_token_from_env
from worker.cli_args import (
    metrics_options,
    parse_worker_args,
    run_worker_process,
    tier_config_from_args,
)


async def serve(args: argparse.Namespace) -> None:
    from decode_service.server import DEFAULT_PORT, start_decode_worker  # torch
    from worker.server import run_until_signal

    config = engine_config_from_args(args, role="decode")
    handle = await start_decode_worker(
        config, args.host, args.port if args.port is not None else DEFAULT_PORT,
        auth_token=internal_token_from_env(), tiers=tier_config_from_args(args),
        kv_transports=args.kv_transports, kv_tcp_streams=args.kv_tcp_streams,
        kv_peers=args.kv_peers, metrics=metrics_options(args))
    await run_until_signal(lambda: handle.drain(args.drain_timeout), watch=handle.load_task)


def run(args: argparse.Namespace) -> int:
    return run_worker_process(args, "decode", lambda: serve(args))


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_worker_args("python -m decode_service", __doc__, argv))
