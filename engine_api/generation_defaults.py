"""The model's recommended sampling defaults, from its `generation_config.json`, as vLLM applies
them (`--generation-config auto`, its default since 0.7): a request that leaves temperature,
top_p, top_k, min_p, repetition_penalty or max_tokens unset gets the model creator's value
instead of the neutral one. "vllm" ignores the file; a directory reads that one's file; an
override (`--override-generation-config '{"temperature": 0.5}'`) is applied on top.

Only values that differ from Hugging Face's own `GenerationConfig` defaults count: vLLM reads
`GenerationConfig.to_diff_dict()`, which drops them (so a file's `"top_k": 50` — HF's default —
sets nothing). No torch here: the gateway imports this module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

# Hugging Face GenerationConfig's defaults of the keys vLLM takes (None: no default).
_HF_DEFAULTS: dict[str, float | int | None] = {
    "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None,
    "max_new_tokens": None}
MODES = ("auto", "vllm")


class GenerationConfigError(ValueError):
    """A generation config or override this server cannot apply; the message names the key."""


def read_generation_config(model_dir: str) -> dict[str, object]:
    """`model_dir`/generation_config.json as a dict ({} when there is none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    return data


def sampling_defaults(generation_config: Mapping[str, object],
                      override: Mapping[str, object] | None = None,
                      source: str = "generation_config.json") -> dict[str, float | int]:
    """Engine `SamplingParams` defaults (temperature, top_p, top_k, min_p, repetition_penalty,
    max_tokens) from a generation config's non-default values, `override` on top (any value,
    as given). GenerationConfigError names a bad value and where it came from."""
    picked: dict[str, tuple[object, str]] = {
        k: (v, source) for k, v in generation_config.items()
        if k in _HF_DEFAULTS and v is not None and v != _HF_DEFAULTS[k]}
    for key, value in (override or {}).items():
        if key not in _HF_DEFAULTS:
            raise GenerationConfigError(f"override generation config: {key!r} is not one of "
                                        f"{', '.join(_HF_DEFAULTS)}")
        picked[key] = (value, "override generation config")
    return {("max_tokens" if k == "max_new_tokens" else k): _checked(k, v, where)
            for k, (v, where) in picked.items()}


def _checked(key: str, value: object, where: str) -> float | int:
    """`value` of `key` as the engine takes it; GenerationConfigError when out of range."""
    def bad(rule: str) -> GenerationConfigError:
        return GenerationConfigError(f"{where}: {key} must be {rule}, got {value!r}")

    if key in ("top_k", "max_new_tokens"):
        if type(value) is not int:
            raise bad("an integer")
        if key == "top_k":
            if value < -1:
                raise bad("-1 or more (0 and -1: no top-k)")
            return -1 if value == 0 else value
        if value < 1:
            raise bad("at least 1")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad("a finite number")
    number = float(value)
    if key == "temperature" and number < 0:
        raise bad("at least 0")
    if key == "top_p" and not 0 < number <= 1:
        raise bad("in (0, 1]")
    if key == "min_p" and not 0 <= number <= 1:
        raise bad("in [0, 1]")
    if key == "repetition_penalty" and number <= 0:
        raise bad("above 0")
    return number


def resolve_sampling_defaults(mode: str, model_dir: str | None,
                              override: Mapping[str, object] | None = None
                              ) -> dict[str, float | int]:
    """`mode` "auto": the file in `model_dir` (none for a model without a directory, such as a
    GGUF file); "vllm": none; else a directory holding the file. Then `override`."""
    if mode == "vllm":
        config: dict[str, object] = {}
        where = "vllm"
    else:
        directory = model_dir if mode == "auto" else mode
        if mode != "auto" and not os.path.isdir(mode):
            raise GenerationConfigError(f"generation config: {mode!r} is neither 'auto', "
                                        "'vllm' nor a directory")
        config = read_generation_config(directory) if directory else {}
        where = os.path.join(directory or "", "generation_config.json")
    return sampling_defaults(config, override, where)
