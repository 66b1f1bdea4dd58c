"""Speculative decoding's configuration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from engine_api.errors import ConfigError

SpecMethod = Literal["none", "ngram", "suffix", "draft_model"]
SPEC_METHODS: tuple[SpecMethod, ...] = get_args(SpecMethod)  # "none" first

# Each draft is one more query row per sequence in the verify step; beyond a handful the
# acceptance of the last drafts is small and the step's extra rows cost more than they save.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/): a proposer drafts tokens, the target model verifies
    them all in one step, and a rejection sampler keeps the target's distribution exactly.

    `method` enables the capability; each request may then ask for fewer drafts, or none (the
    gateway turns it off under load). "ngram" is prompt lookup: the longest suffix of the
    sequence, `prompt_lookup_max` down to `prompt_lookup_min` tokens long, that occurred earlier
    proposes the tokens that followed it (vLLM's `ngram` method). "draft_model" runs `model`, a
    smaller model with the target's vocabulary, greedily for the drafts (vLLM's draft model;
    engine/draft_model.py); it runs on the target's device with its own KV cache. "suffix" is
    suffix decoding (engine/spec/suffix.py; vLLM's `suffix` method): suffix trees over the
    request's tokens and the worker's recent outputs, `suffix_decoding_*` its knobs.

    Whatever the method, a worker also has n-gram lookup and suffix decoding (no weights, no
    cost unless a request uses them), so the gateway can choose per request."""

    method: SpecMethod = "none"
    num_speculative_tokens: int = 4     # drafts per step at most
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # A request whose verify steps recently accepted fewer drafts than this per step (moving
    # average) pauses drafting for SPEC_PROBE_INTERVAL steps, then tries again: below it a
    # verify step costs more than the tokens it saves. Measured break-even with 4 drafts: 0.32
    # on an H200 at batch 1 (a verify step costs 1.32 decode steps,
    # bench/results/h200/ab_verify_decode_*_6f732f8.json), 0.53 on this project's CPU
    # (bench/results/cpu_probe_spec_smollm2.json). 0: never pause.
    min_accepted_per_step: float = 0.4
    # method "draft_model": the draft's weights (a path, or "dummy:<preset>" as for the target).
    model: str = ""
    # The draft's share of the device's memory (its weights, activations and KV cache; the
    # target's KV cache is sized after it). Ignored on the CPU, where the draft's cache takes
    # `CacheConfig.cpu_kv_cache_bytes` as the target's does.
    draft_gpu_memory_utilization: float = 0.1
    # Suffix decoding (vLLM's names): the trees' depth, the shared tree's requests, the draft
    # length per matched token, and the least probability a drafted token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Start-up measurement of step cost (engine/spec/calibrate.py): batches up to this many
    # sequences, plain and verifying; 0: none (live steps alone fill the cost model).
    calibration_max_batch: int = 32
    # Lower each request's drafts per step to what pays for the batch as it is now, from the
    # measured step cost and acceptance (engine/spec/budget.py); False: the request's cap.
    step_budget: bool = True

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative method must be one of "
                              f"{', '.join(map(repr, SPEC_METHODS))}, got {self.method!r}")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ConfigError("suffix_decoding_max_tree_depth must be >= 1, got "
                              f"{self.suffix_decoding_max_tree_depth!r}")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("suffix_decoding_max_cached_requests must be >= 0, got "
                              f"{self.suffix_decoding_max_cached_requests!r}")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError("suffix_decoding_max_spec_factor must be > 0, got "
                              f"{self.suffix_decoding_max_spec_factor!r}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError("suffix_decoding_min_token_prob must be in [0, 1], got "
                              f"{self.suffix_decoding_min_token_prob!r}")
        if self.calibration_max_batch < 0:
            raise ConfigError("calibration_max_batch must be >= 0, got "
                              f"{self.calibration_max_batch!r}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative method 'draft_model' needs the draft's `model` (a path "
                              "or dummy:<preset>)")
        if not 0.0 < self.draft_gpu_memory_utilization < 1.0:
            raise ConfigError("draft_gpu_memory_utilization must be in (0, 1), got "
                              f"{self.draft_gpu_memory_utilization!r}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                              f"got {self.num_speculative_tokens}")
        floor = self.min_accepted_per_step
        if not isinstance(floor, (int, float)) or not 0 <= floor <= self.num_speculative_tokens:
            raise ConfigError("min_accepted_per_step must be in [0, num_speculative_tokens], got "
                              f"{self.min_accepted_per_step!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("prompt lookup n-gram sizes must satisfy 1 <= prompt_lookup_min <= "
                              f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                              f"{self.prompt_lookup_max}")


def speculative_config_from_dict(spec: dict[str, Any], base: SpeculativeConfig | None = None
                                 ) -> SpeculativeConfig:
    """vLLM's `speculative_config` ({"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4}, or {"model": <draft>, ...}: the method follows from `model`) over
    `base`'s fields; validated. ConfigError names an unknown key or a bad value."""
    if not isinstance(spec, dict):
        raise ConfigError(f"speculative config must be a JSON object, got {type(spec).__name__}")
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(spec) - names)
    if unknown:
        raise ConfigError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(sorted(names))})")
    fields = dict(spec)
    if fields.get("model") and "method" not in fields:
        fields["method"] = "draft_model"
    try:
        config = dataclasses.replace(base or SpeculativeConfig(), **fields)
    except TypeError as e:
        raise ConfigError(f"speculative config: {e}") from None
    for f in dataclasses.fields(SpeculativeConfig):
        value = getattr(config, f.name)
        types: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float),
                                                     "str": str}
        want = types.get(str(f.type))
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            raise ConfigError(f"speculative config: {f.name} must be {f.type}, got {value!r}")
    config.validate()
    return config


def parse_speculative_config(text: str, base: SpeculativeConfig | None = None
                             ) -> SpeculativeConfig:
    """`--speculative-config`'s JSON text → the config (over `base`: the single flags)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
    return speculative_config_from_dict(spec, base)
