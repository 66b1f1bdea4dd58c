"""Model shapes the benchmarks need without loading a model: dummy presets and vocab sizes.

Presets come from the engine (`engine.loader.presets.PRESETS`, name → HF config dict) when it
is importable; otherwise from the inline Llama-3.1-8B shape below, so the `transformers`
baseline can run on a machine where the engine is broken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DUMMY_PREFIX = "dummy:"

# Llama-3.1-8B (DESIGN.md §7); used only when the engine's presets cannot be imported.
FALLBACK_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
}


class ModelSpecError(ValueError):
    """An unknown preset or unreadable model path; the message lists what is allowed."""


def load_presets() -> dict[str, dict[str, Any]]:
    try:
        from engine.loader.presets import PRESETS
    except ImportError:
        return dict(FALLBACK_PRESETS)
    return dict(PRESETS)


def preset_config(model: str) -> dict[str, Any]:
    """The HF config dict of "dummy:<preset>" or "<preset>"."""
    name = model.removeprefix(DUMMY_PREFIX)
    presets = load_presets()
    if name not in presets:
        raise ModelSpecError(
            f"--model {model!r}: unknown preset; known: {', '.join(sorted(presets))}"
        )
    return dict(presets[name])


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
