"""`splitserve {generate,serve,up,bench,health,kv-scales}` — dispatches lazily so `splitserve serve --role gateway`
never imports torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "generate": ("engine.cli", "generate text in-process with the engine"),
    "serve": ("splitserve.serve", "start one service: --role prefill|decode|colocated|gateway"),
    "up": ("splitserve.up", "start gateway + prefill + decode on this machine"),
    "bench": ("bench.cli", "benchmarks (online against the REST API, offline in-process)"),
    "health": ("splitserve.health", "probe a worker's gRPC health (TLS when configured)"),
    "kv-scales": ("engine.kv_scales_cli", "calibrate an fp8/int8 KV cache's scales into a file"),
}


def usage() -> str:
    lines = ["usage: splitserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<11}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "splitserve <command> --help for a command's options"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"splitserve: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command[0])
    return int(module.main(args[1:]) or 0)
