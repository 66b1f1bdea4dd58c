"""Model shapes the benchmarks need without loading a model: dummy presets and vocab sizes.

Presets come from the engine (`engine.loader.presets.PRESETS`, name → HF config dict), the
single source of the shapes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

DUMMY_PREFIX = "dummy:"

class ModelSpecError(ValueError):
    """An unknown preset or unreadable model path; the message lists what is allowed."""


def load_presets() -> dict[str, dict[str, Any]]:
    """Deep copies: consumers such as `transformers.LlamaConfig(**d)` mutate nested dicts."""
    from engine.loader.presets import PRESETS  # torch-free: name -> HF config dict

    return copy.deepcopy(PRESETS)


def preset_config(model: str) -> dict[str, Any]:
    """The HF config dict of "dummy:<preset>" or "<preset>"."""
    name = model.removeprefix(DUMMY_PREFIX)
    presets = load_presets()
    if name not in presets:
        raise ModelSpecError(
            f"--model {model!r}: unknown preset; known: {', '.join(sorted(presets))}"
        )
    return presets[name]


def vocab_size_for(model: str) -> int:
    """Vocabulary size of a dummy preset or an HF directory (its config.json)."""
    if model.startswith(DUMMY_PREFIX):
        return int(preset_config(model)["vocab_size"])
    config = Path(model) / "config.json"
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (OSError, KeyError, ValueError) as e:
        raise ModelSpecError(
            f"--model {model!r}: cannot read vocab_size from {config} ({e}); pass --vocab-size"
        ) from e
