"""Structured outputs' constraints tried in a child process before a worker serves them, so one
request's constraint cannot stall the others (a "grammar bomb").

Two costs are bounded. Compiling: a grammar of chained alternatives compiled for minutes
(2,000 rules, 65 KB). Masking: the engine fills every constrained row's mask of allowed tokens
on its own thread each step, and for such a grammar one mask took seconds (500 rules: 7-14 s
a step, on the CPU of the development machine), stalling every request the engine runs. So a
new constraint is compiled, and its first mask filled, in a child process under a deadline
(`GrammarLimits.compile_timeout_s`, the child killed past it); a constraint whose first mask
takes longer than `GrammarLimits.max_mask_ms` is refused as too complex to serve. Either way
the client gets a 400 (INVALID_ARGUMENT) naming the field; the verdict is kept by the
constraint's text, so the same one is refused at once. A constraint that passes is compiled
again in the worker (milliseconds: it just did in the child). The engine's step loop never
waits on any of this: `AsyncEngine` compiles in threads of its own before queueing the request.

One child per worker process (shared by its engines, a compiler per vocabulary), started on
the first constraint to try and restarted after a kill; its start (importing xgrammar, which
imports torch) does not count against the deadline. Constraints are tried one at a time, so a
bomb delays other new constraints by at most the deadline; a constraint compiled before
(the worker's cache) is not tried again. `choice` and `json_object` are bounded by their form
and not tried. A prompt goes to a prefill worker first, which refuses a bomb; the decode
worker never sees it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine_api.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

# The child's start (imports) may take this long on a busy host before it counts as failed.
STARTUP_TIMEOUT_S = 300.0
_VERDICTS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """compile_timeout_s: compiling a new constraint (and filling its first mask) may take this
    long; max_mask_ms: filling its first mask may take this long (a usual JSON schema's takes
    well under 1 ms, a regex's or a choice's less)."""

    compile_timeout_s: float = 10.0
    max_mask_ms: float = 50.0


class GrammarVetting:
    """Tries one vocabulary's new constraints in the shared child process."""

    def __init__(self, vocab: Sequence[str], metadata: str, limits: GrammarLimits) -> None:
        """vocab, metadata: the vocabulary as the worker's xgrammar compiler reads it (each
        token's text; `TokenizerInfo.dump_metadata()`)."""
        self._vocab = list(vocab)
        self._metadata = metadata
        self.key = hashlib.sha256(json.dumps([self._vocab, metadata]).encode()).hexdigest()
        self.limits = limits
        self._verdicts: OrderedDict[StructuredOutputs, str | None] = OrderedDict()

    def vet(self, spec: StructuredOutputs) -> str | None:
        """None when `spec` may be served; else why not (the client's error message)."""
        with _LOCK:
            if spec in self._verdicts:
                self._verdicts.move_to_end(spec)
                return self._verdicts[spec]
            verdict = _child().vet(self, spec)
            self._verdicts[spec] = verdict
            while len(self._verdicts) > _VERDICTS_KEPT:
                self._verdicts.popitem(last=False)
            return verdict

    def describe(self) -> dict[str, Any]:
        """The child's message that teaches it this vocabulary."""
        return {"op": "vocab", "key": self.key, "vocab": self._vocab,
                "metadata": self._metadata}


class _Child:
    """The child process (`python -m engine.grammar_child`, framed messages over its stdin and
    stdout) and what it knows; used under `_LOCK`."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "engine.grammar_child"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        assert self._process.stdin is not None and self._process.stdout is not None
        self._out = Connection(os.dup(self._process.stdin.fileno()), readable=False)
        self._in = Connection(os.dup(self._process.stdout.fileno()), writable=False)
        self._known: set[str] = set()
        self._started = False  # its "ready" read (awaited on first use, not at spawn)

    def _reply(self, timeout_s: float, what: str) -> bytes:
        if not self._in.poll(timeout_s):
            self.kill()
            raise RuntimeError(f"the grammar vetting process did not {what}")
        return self._in.recv_bytes()

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def vet(self, vetting: GrammarVetting, spec: StructuredOutputs) -> str | None:
        field = f"structured_outputs.{spec.kind}"
        limits = vetting.limits
        if not self._started:  # importing xgrammar and torch: not timed
            self._reply(STARTUP_TIMEOUT_S, "start")
            self._started = True
        if vetting.key not in self._known:  # building its TokenizerInfo: not timed
            self._out.send_bytes(json.dumps(vetting.describe()).encode())
            self._reply(STARTUP_TIMEOUT_S, "take a vocabulary")
            self._known.add(vetting.key)
        self._out.send_bytes(json.dumps({"op": "vet", "key": vetting.key,
                                         "spec": dataclasses.asdict(spec)}).encode())
        if not self._in.poll(limits.compile_timeout_s):
            self.kill()
            prestart_locked()  # the next constraint need not wait for a whole start
            logger.warning("a %s constraint did not compile in %.1f s: refused", spec.kind,
                           limits.compile_timeout_s)
            return (f"{field} did not compile within {limits.compile_timeout_s:g} s: it is too "
                    "complex to serve")
        reply = json.loads(self._in.recv_bytes())
        if reply.get("error"):
            return str(reply["error"])
        mask_ms = float(reply["mask_ms"])
        if mask_ms > limits.max_mask_ms:
            logger.warning("a %s constraint's first token mask took %.0f ms: refused",
                           spec.kind, mask_ms)
            return (f"{field} is too complex to serve: its first token mask took {mask_ms:.0f} "
                    f"ms to compute, and every step would take about as long (the limit is "
                    f"{limits.max_mask_ms:g} ms)")
        return None

    def kill(self) -> None:
        self._process.kill()
        self._process.wait(5)
        for conn in (self._in, self._out):
            conn.close()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()


_LOCK = threading.Lock()
_CHILD: _Child | None = None


def _child() -> _Child:
    prestart_locked()
    assert _CHILD is not None
    return _CHILD


def prestart() -> None:
    """Start the child unless it runs (it imports while the caller does other work)."""
    with _LOCK:
        prestart_locked()


def prestart_locked() -> None:
    global _CHILD
    if _CHILD is None or not _CHILD.alive:
        _CHILD = _Child()

