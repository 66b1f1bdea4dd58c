"""Benchmark workloads (prompts as token ids) and request arrival processes, all seeded.

- `random`: prompts of random token ids in [0, vocab_size); input/output lengths fixed, or
  drawn uniformly from [len*(1-r), len*(1+r)] with --random-range-ratio r (vLLM's meaning).
- `shared-prefix`: `num_groups` groups; every prompt of a group starts with the group's
  `prefix_len`-token prefix followed by its own random `suffix_len` tokens (exercises the
  prefix cache). Requests of all groups are shuffled together.
- arrivals: gaps drawn from Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean
  rate is `request_rate` and burstiness 1 is a Poisson process; rate inf sends all at once.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import numpy as np


class WorkloadError(ValueError):
    """A bad workload parameter; the message names it and what is allowed."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int
    lora_name: str | None = None  # the LoRA adapter it runs (its `model`); None: the base model

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WorkloadError(f"{name} must be an integer >= 1, got {value!r}")


def _check_range_ratio(ratio: float) -> None:
    if not 0.0 <= ratio < 1.0:
        raise WorkloadError(f"random_range_ratio must be in [0, 1), got {ratio!r}")


def _lengths(rng: np.random.Generator, n: int, base: int, ratio: float) -> list[int]:
    low = max(1, math.floor(base * (1.0 - ratio)))
    high = max(low, math.ceil(base * (1.0 + ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """The `random` workload; identical for the same arguments."""
    for name, value in (("num_requests", num_requests), ("input_len", input_len),
                        ("output_len", output_len), ("vocab_size", vocab_size)):
        _check_positive(name, value)
    _check_range_ratio(range_ratio)
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_requests, input_len, range_ratio)
    out_lens = _lengths(rng, num_requests, output_len, range_ratio)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=n_in).tolist(), n_out)
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_requests(
    num_requests: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """The `shared-prefix` workload: request i belongs to group i % num_groups, then shuffled."""
    for name, value in (("num_requests", num_requests), ("num_groups", num_groups),
                        ("prefix_len", prefix_len), ("suffix_len", suffix_len),
                        ("output_len", output_len), ("vocab_size", vocab_size)):
        _check_positive(name, value)
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, size=prefix_len).tolist() for _ in range(num_groups)]
    requests = [
        BenchRequest(prefixes[i % num_groups] + rng.integers(0, vocab_size, size=suffix_len).tolist(),
                     output_len)
        for i in range(num_requests)
    ]
    order = rng.permutation(num_requests)
    return [requests[int(i)] for i in order]


def arrival_gaps(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Seconds between consecutive sends (the first gap is before the first request)."""
    _check_positive("num_requests", num_requests)
    if not request_rate > 0:
        raise WorkloadError(f"request_rate must be > 0 (inf: all at once), got {request_rate!r}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise WorkloadError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [float(g) for g in rng.gamma(shape=burstiness, scale=scale, size=num_requests)]


def arrival_times(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    normalize: bool = True,
) -> list[float]:
    """Send offsets in seconds from the start of the run, non-decreasing.

    With `normalize` the offsets are rescaled so the last one is exactly
    num_requests / request_rate, as vLLM does to keep throughput stable across seeds.
    """
    offsets = np.cumsum(arrival_gaps(num_requests, request_rate, burstiness, seed))
    if normalize and not math.isinf(request_rate) and offsets[-1] > 0:
        offsets = offsets * ((num_requests / request_rate) / offsets[-1])
    return [float(t) for t in offsets]


def assign_adapters(requests: list[BenchRequest], names: list[str], seed: int = 0
                    ) -> list[BenchRequest]:
    """Each request runs one of the LoRA adapters `names`, chosen at random (seeded), as
    `vllm bench serve --lora-modules` picks them; no names: the requests as they are."""
    if not names:
        return requests
    rng = random.Random(seed)
    return [dataclasses.replace(r, lora_name=rng.choice(names)) for r in requests]
