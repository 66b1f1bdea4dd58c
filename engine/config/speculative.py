"""Speculative decoding's configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from engine_api.errors import ConfigError

SpecMethod = Literal["none", "ngram", "draft_model"]
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
    engine/draft_model.py); it runs on the target's device with its own KV cache."""

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

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative method must be 'none', 'ngram' or 'draft_model', got "
                              f"{self.method!r}")
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
