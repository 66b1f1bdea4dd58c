"""The grammar vetting child process (engine/grammar_vetting.py): `python -m
engine.grammar_child`, messages framed over its stdin and stdout. It learns vocabularies and
tries constraints: each compiled and its first token mask filled, timed; its parent kills it
when one takes too long."""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from engine.structured import compile_spec
from engine_api.sampling_params import StructuredOutputs


def serve(requests: Connection, replies: Connection) -> None:
    """Answer until the parent goes."""
    import xgrammar as xgr

    compilers: dict[str, tuple[Any, Any]] = {}
    replies.send_bytes(b"{}")  # ready
    while True:
        try:
            message = json.loads(requests.recv_bytes())
        except (EOFError, OSError):
            return
        if message["op"] == "vocab":
            info = xgr.TokenizerInfo.from_vocab_and_metadata(message["vocab"],
                                                             message["metadata"])
            compilers[message["key"]] = (xgr.GrammarCompiler(info, max_threads=1),
                                         xgr.allocate_token_bitmask(1, info.vocab_size))
            replies.send_bytes(b"{}")
            continue
        compiler, bitmask = compilers[message["key"]]
        fields = message["spec"]
        if fields.get("choice") is not None:
            fields["choice"] = tuple(fields["choice"])
        try:
            matcher = xgr.GrammarMatcher(compile_spec(compiler, StructuredOutputs(**fields)))
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            reply: dict[str, Any] = {"mask_ms": (time.perf_counter() - start) * 1e3}
        except ValueError as exc:  # the constraint's own error, for the client
            reply = {"error": str(exc)}
        replies.send_bytes(json.dumps(reply).encode())


def main() -> None:
    os.nice(10)  # the serving process comes first
    replies = Connection(os.dup(sys.stdout.fileno()), readable=False)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not break the framing
    serve(Connection(os.dup(sys.stdin.fileno()), writable=False), replies)


if __name__ == "__main__":
    main()
