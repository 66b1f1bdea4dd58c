"""Model sources: Hugging Face directories, GGUF files and dummy presets.

`load_model_source` and `ModelSource` need torch, so they are imported lazily: the torch-free
parts (`errors`, `gguf_meta`) stay importable by the tokenizer and the gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_api.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.loader.load import load_model_source
    from engine.loader.source import ModelSource

__all__ = ["ModelLoadError", "ModelSource", "load_model_source"]


def __getattr__(name: str) -> Any:
    if name == "load_model_source":
        from engine.loader.load import load_model_source

        return load_model_source
    if name == "ModelSource":
        from engine.loader.source import ModelSource

        return ModelSource
    raise AttributeError(f"module 'engine.loader' has no attribute {name!r}")
