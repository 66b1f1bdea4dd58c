"""The engine's default pooling for embedding requests: the engine's override
(`PoolerConfig`, `--pooling-type`), else the model's sentence-transformers files, else LAST and
normalized (what decoder embedding models such as Qwen3-Embedding use). Torch-free.

A sentence-transformers model directory names its modules in `modules.json`: a `Pooling`
module whose `config.json` sets one `pooling_mode_*` flag, and a `Normalize` module when the
embeddings are L2-normalized (vLLM reads the same files the same way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine_api.pooling_params import PoolerConfig, PoolingType

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_MODES: dict[str, PoolingType] = {"pooling_mode_lasttoken": "LAST",
                                  "pooling_mode_mean_tokens": "MEAN",
                                  "pooling_mode_cls_token": "CLS"}


def resolve_pooler(override: PoolerConfig, model: str) -> PoolerConfig:
    """Every field set: `override`'s, else the model's (when `model` is a directory with
    sentence-transformers files), else LAST and normalized. ConfigError for files that cannot
    be read or a pooling mode this engine lacks (unless `override` names the pooling type)."""
    own = PoolerConfig()
    if model and Path(model).is_dir():
        own = sentence_transformers_pooler(Path(model), override.pooling_type is None) or own
    normalize = override.normalize if override.normalize is not None else own.normalize
    return PoolerConfig(override.pooling_type or own.pooling_type or "LAST",
                        True if normalize is None else normalize)


def sentence_transformers_pooler(model_dir: Path, needs_type: bool = True) -> PoolerConfig | None:
    """The pooling `model_dir`'s sentence-transformers files describe (None: it has no
    `modules.json`); `pooling_type` None when they name no Pooling module. `needs_type`: a
    pooling mode this engine lacks is an error (else it is left unset)."""
    modules = _read_json(model_dir / "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{model_dir / 'modules.json'}: expected a list of modules")
    types = [m.get("type") for m in modules]
    normalize = _NORMALIZE_MODULE in types
    pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    if pooling is None:
        return PoolerConfig(normalize=normalize)
    path = model_dir / str(pooling.get("path") or "") / "config.json"
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the Pooling module's configuration is missing or not an "
                          "object")
    chosen = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
    if len(chosen) == 1 and chosen[0] in _MODES:
        return PoolerConfig(_MODES[chosen[0]], normalize)
    if needs_type:
        raise ConfigError(f"{path}: pooling modes {chosen or 'none'}; this engine pools by one "
                          f"of {sorted(_MODES)}: choose one with --pooling-type")
    return PoolerConfig(normalize=normalize)


def _read_json(path: Path) -> Any:
    """The file's JSON (None: no such file); ConfigError when it is not JSON."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read sentence-transformers configuration: {e}") from None
