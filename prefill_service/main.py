"""`splitserve serve --role prefill` (or `python -m prefill_service`): one prefill worker."""

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
    from prefill_service.server import DEFAULT_PORT, start_prefill_worker  # torch
    from worker.server import run_until_signal

    config = engine_config_from_args(args, role="prefill")
    handle = await start_prefill_worker(
        config, args.host, args.port if args.port is not None else DEFAULT_PORT,
        advertise_address=args.advertise, auth_token=internal_token_from_env(),
        tiers=tier_config_from_args(args), kv_data_port=args.kv_data_port,
        metrics=metrics_options(args))
    await run_until_signal(lambda: handle.drain(args.drain_timeout), watch=handle.load_task)


def run(args: argparse.Namespace) -> int:
    return run_worker_process(args, "prefill", lambda: serve(args))


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_worker_args("python -m prefill_service", __doc__, argv))
