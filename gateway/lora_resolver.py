"""The bookkeeping of vLLM's filesystem LoRA resolver (`--lora-resolver-dir DIR`): which names
DIR holds an adapter directory for, which adapters this resolver loaded, and when requests last
named them (gateway/model_resolution.py loads and unloads them).

It depends on nothing of the gateway's live state, so `GatewayState` can hold one: the loading
and unloading, which need that state, live a layer up.
"""

from __future__ import annotations

import asyncio
import os
import time

from engine_api.lora import LORA_NAME_RE


class LoRAResolver:
    """Adapters loaded when a request first names them: DIR/<model> is the adapter `model`."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.last_used: dict[str, float] = {}  # adapter -> when a request last named it
        self.loaded: set[str] = set()  # the adapters this resolver loaded (it may unload them)
        self.lock = asyncio.Lock()  # one resolution at a time: two requests, one load

    def touch(self, name: str) -> None:
        self.last_used[name] = time.monotonic()

    def directory(self, name: str) -> str | None:
        """DIR/<name> when `name` is an adapter name and that directory exists (a link out of
        DIR is followed: the operator put it there); None otherwise."""
        if not LORA_NAME_RE.match(name):  # the engine's rule: no '/', no leading '.'
            return None
        path = os.path.join(self.root, name)
        return path if os.path.isdir(path) else None

    def victims(self, served: set[str], spared: set[str]) -> list[str]:
        """The adapters this resolver loaded that the workers serve, least recently used first,
        but for those `spared` (the one to load, busy ones, ones a worker refused)."""
        return sorted((n for n in self.loaded & served if n not in spared),
                      key=lambda n: self.last_used.get(n, 0.0))
