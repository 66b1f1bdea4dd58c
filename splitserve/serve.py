"""`splitserve serve [MODEL] [--role {colocated,prefill,decode,gateway}]`: start one service.

As `vllm serve MODEL`: the model may come first, in place of `--model MODEL`; without `--role`
the process is `colocated` (the whole REST and gRPC surface in one process).

Each role is its service's own entry point (prefill_service/main.py, decode_service/main.py,
gateway/server.py); `colocated` (splitserve/colocated.py) is one process with the same gRPC and
REST surface as the whole stack: an engine worker (prefill + decode in one engine) on an
internal loopback port and the gateway in front.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from splitserve import colocated
from worker.cli_args import add_worker_args, run_worker_process

ROLES = ("prefill", "decode", "colocated", "gateway")


def build_parser() -> argparse.ArgumentParser:
    """The engine workers' flags with `--role`."""
    p = argparse.ArgumentParser(prog="splitserve serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default="colocated", choices=list(ROLES),
                   help="which service (default: colocated, the whole surface in one process)")
    add_worker_args(p)
    return p


def build_serve_parser() -> argparse.ArgumentParser:
    """`build_parser` plus the flags of the colocated role's in-process gateway."""
    parser = build_parser()
    colocated.add_colocated_args(parser)
    return parser


def _role(argv: list[str]) -> str | None:
    if "--role" in argv:
        following = argv[argv.index("--role") + 1 : argv.index("--role") + 2]
        return following[0] if following else None
    return None


def positional_model(argv: list[str]) -> list[str]:
    """`serve MODEL ...` (vLLM's form) as `serve --model MODEL ...`."""
    if argv and not argv[0].startswith("-"):
        return ["--model", argv[0], *argv[1:]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = positional_model(list(argv or []))
    if _role(argv) == "gateway":  # the gateway parses its own flags, and never imports torch
        from gateway.server import main as gateway_main

        rest = [a for i, a in enumerate(argv) if a != "--role" and (i == 0 or argv[i - 1] != "--role")]
        return gateway_main(rest)
    args = build_serve_parser().parse_args(argv)
    if args.role == "prefill":
        from prefill_service.main import run as run_prefill

        return run_prefill(args)
    if args.role == "decode":
        from decode_service.main import run as run_decode

        return run_decode(args)
    return run_worker_process(args, "colocated", lambda: colocated.serve(args),
                              precheck=lambda: colocated.precheck(args))
