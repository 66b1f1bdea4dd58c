"""Multi-LoRA serving's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from engine_api.errors import ConfigError
from engine_api.lora import LORA_NAME_RE

# Adapters' ranks above this are refused (vLLM's --max-lora-rank default is 16; PEFT adapters in
# use rarely exceed 64, and each rank costs every adapted row two thin matmuls per projection).
DEFAULT_MAX_LORA_RANK = 64
# Slots are allocated in every projection of every layer: a ceiling that catches a typo.
MAX_LORAS = 64


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (engine/lora/): PEFT adapters loaded at start, each request choosing
    one by name (or none) — vLLM's `--enable-lora --lora-modules name=path`. The adapters'
    deltas are added to the projections they target (q/k/v/o, gate/up/down) for the rows of
    the requests that chose them; every other row computes the base model."""

    modules: tuple[tuple[str, str], ...] = ()  # (name, adapter directory)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # Adapter slots on the device (vLLM's --max-loras). 0: exactly `modules`, packed (the
    # least work per step), none added later. > 0: that many slots of rank `max_lora_rank`,
    # `modules` in the first, adapters loaded and unloaded at runtime
    # (`LLMEngine.add_lora` / `remove_lora`) — every projection then pays for every slot.
    max_loras: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or self.max_loras > 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    def validate(self) -> None:
        if type(self.max_lora_rank) is not int or not 1 <= self.max_lora_rank <= 1024:
            raise ConfigError(f"max_lora_rank must be an integer in [1, 1024], got "
                              f"{self.max_lora_rank!r}")
        if type(self.max_loras) is not int or not 0 <= self.max_loras <= MAX_LORAS:
            raise ConfigError(f"max_loras must be an integer in [0, {MAX_LORAS}], got "
                              f"{self.max_loras!r}")
        if self.max_loras and len(self.modules) > self.max_loras:
            raise ConfigError(f"{len(self.modules)} LoRA modules given for max_loras "
                              f"{self.max_loras} slots")
        seen: set[str] = set()
        for name, path in self.modules:
            if not isinstance(name, str) or not LORA_NAME_RE.match(name):
                raise ConfigError(f"LoRA adapter name {name!r} must be 1-128 characters of "
                                  "letters, digits and . _ : - (starting with a letter or digit)")
            if name in seen:
                raise ConfigError(f"LoRA adapter name {name!r} is given twice")
            if not isinstance(path, str) or not path:
                raise ConfigError(f"LoRA adapter {name!r} needs a directory")
            seen.add(name)
