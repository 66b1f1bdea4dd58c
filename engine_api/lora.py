"""LoRA adapter names and vLLM's `LoRARequest`, for offline code written against it: a request names a loaded adapter
(`LLM(lora_modules=...)`), or, on an engine with adapter slots (`max_loras`), one that `LLM`
loads from `lora_path` on first use; a path, when given, must be the one that name was loaded
from."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# What an adapter may be called: checked by the engine's config, the gateway's resolver and the
# runtime load endpoints alike.
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int = 0   # vLLM's adapter id; unused (names identify adapters here)
    lora_path: str = ""


def lora_name_of(request: LoRARequest | str | None,
                 loaded: dict[str, str] | None = None) -> str | None:
    """The adapter name a request asks for; ValueError when its path is not the one `loaded`
    (name -> path) has under that name."""
    if request is None or isinstance(request, str):
        return request
    if request.lora_path and loaded is not None:
        have = loaded.get(request.lora_name)
        if have is not None and os.path.realpath(have) != os.path.realpath(request.lora_path):
            raise ValueError(f"LoRA adapter {request.lora_name!r} was loaded from {have}, not "
                             f"{request.lora_path} (unload it first to load other files under that name)")
    return request.lora_name
