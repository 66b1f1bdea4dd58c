"""Load a Hugging Face model directory: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from engine.config import TEXT_ONLY_ARCHITECTURES, ModelConfig, hf_architecture
from engine.loader.safetensors_check import read_header
from engine.loader.source import (
    ModelSource,
    check_weight_names,
    dtype_from_name,
    loaded_weight_name,
)
from engine_api.errors import ModelLoadError

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def read_json(path: str) -> Any:
    """Parsed JSON file; ModelLoadError naming the file on bad JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e


def read_config_dict(model_dir: str) -> dict[str, Any]:
    """config.json of `model_dir` as a dict; ModelLoadError if absent or malformed."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    d = read_json(path)
    if not isinstance(d, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return normalize_rope(d)


def normalize_rope(d: dict[str, Any]) -> dict[str, Any]:
    """Lift transformers>=5's `rope_parameters` into the classic `rope_theta`/`rope_scaling`
    keys that ModelConfig.from_hf_dict reads (keys already at top level win)."""
    params = d.get("rope_parameters")
    if not isinstance(params, dict):
        return d
    d = dict(d)
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    if "rope_theta" in params:
        d.setdefault("rope_theta", params["rope_theta"])
    if rest.get("rope_type", "default") != "default" and not d.get("rope_scaling"):
        d["rope_scaling"] = rest
    return d


def safetensors_files(model_dir: str) -> list[str]:
    """Shard paths in order: from model.safetensors.index.json, else model.safetensors / *.safetensors."""
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        files = [os.path.join(model_dir, f) for f in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.isfile(f):
                raise ModelLoadError(f"{index}: shard {f} is missing")
        return files
    single = os.path.join(model_dir, _SINGLE)
    if os.path.isfile(single):
        return [single]
    found = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir)
                   if f.endswith(".safetensors"))
    if not found:
        raise ModelLoadError(f"{model_dir}: no safetensors weights ({_SINGLE} or {_INDEX})")
    return found


LoadedName = Callable[[str], str | None]  # a checkpoint tensor's loaded name, None: not loaded


def _iter_shards(files: list[str], loaded_name: LoadedName
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    # One shard open at a time; tensors are read lazily from the file's mmap.
    for path in files:
        with safe_open(path, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                loaded = loaded_name(name)
                if loaded is not None:
                    yield loaded, sf.get_tensor(name)


def generation_config(model_dir: str) -> dict[str, Any]:
    """generation_config.json as a dict (empty if absent), eos_token_id normalized to a list."""
    path = os.path.join(model_dir, "generation_config.json")
    d = read_json(path) if os.path.isfile(path) else {}
    eos = d.get("eos_token_id")
    if eos is not None:
        d["eos_token_id"] = list(eos) if isinstance(eos, list) else [eos]
    return dict(d)


def chat_template(model_dir: str) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or a list of {name, template} from which "default" is picked), else a
    multimodal checkpoint's processor file chat_template.json (`{"chat_template": ...}`)."""
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = os.path.join(model_dir, name)
        found = pick_template(read_json(path).get("chat_template")) if os.path.isfile(path) else None
        if found is not None:
            return found
    return None


def pick_template(value: Any) -> str | None:
    """A template string from a `chat_template` value (string or list of named templates)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def merged_eos(config_eos: tuple[int, ...], gen: dict[str, Any]) -> tuple[int, ...]:
    """config.json eos ids followed by any extra ones from generation_config.json."""
    extra = [int(e) for e in gen.get("eos_token_id", []) if e not in config_eos]
    return tuple(config_eos) + tuple(dict.fromkeys(extra))


def load_hf_dir(model_dir: str, weights_id: str, tokenizer: str | None) -> ModelSource:
    """ModelSource for HF directory `model_dir`; every shard is validated before returning."""
    d = read_config_dict(model_dir)
    gen = generation_config(model_dir)
    config = ModelConfig.from_hf_dict(d, weights_id=weights_id)
    config = config.replace(eos_token_ids=merged_eos(config.eos_token_ids, gen))
    arch = hf_architecture(d)
    multimodal = arch in TEXT_ONLY_ARCHITECTURES
    if multimodal:
        logger.info("%s: %s served text-only as %s; its vision tower and multimodal projector "
                    "are not loaded", model_dir, arch, config.architecture)
    loaded_name = functools.partial(loaded_weight_name, config=config, multimodal=multimodal)
    files = safetensors_files(model_dir)
    names: set[str] = set()
    for f in files:
        names.update(n for n in map(loaded_name, read_header(f)) if n is not None)
    # A missing tensor is named as the text-only model names it: say whose it is.
    where = f"{model_dir} ({arch}'s language model)" if multimodal else model_dir
    check_weight_names(names, config, where)
    tok_json = os.path.join(model_dir, "tokenizer.json")
    dtype = dtype_from_name(d.get("torch_dtype", d.get("dtype"))) or torch.float32
    return ModelSource(
        config=config,
        weights=lambda: _iter_shards(files, loaded_name),
        tokenizer_source=tokenizer or (tok_json if os.path.isfile(tok_json) else None),
        chat_template=chat_template(model_dir),
        generation_config=gen,
        default_dtype=dtype,
    )
