"""Continuous batching's configuration: the scheduler's budgets, the worker's role and the
engine's garbage-collection thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from engine_api.errors import ConfigError

Role = Literal["colocated", "prefill", "decode"]
# The order requests are admitted, run and preempted in (engine/request_queue.py).
SchedulingPolicy = Literal["fcfs", "priority"]


# CPython's default thresholds (700, 10, 10) run a full collection every ~100 young ones, and a
# full collection walks every live request's token lists: ~30 ms for 1,000 requests of 2,000
# tokens on this project's CPU (tools/probes/probe_gc.py), and 43-44 of them in an offline 1000 x 1000
# run on the H200 (1.5-3.4 s, probe_tput_fp8_768g_*.json -> gc). Young collections stay
# as they were; a full one waits for 1,000 middle-generation collections instead of 10 (as
# SGLang's --gc-threshold and other engines raise them). Cycles that reach the old generation
# live longer; the engine makes few.
DEFAULT_GC_THRESHOLD = (700, 10, 1000)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching and chunked prefill."""

    max_num_seqs: int = 256                 # max requests in one step
    max_num_batched_tokens: int = 2048      # token budget of one step
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None        # None: the model's max_position_embeddings
    role: Role = "colocated"
    kv_lease_ms: int = 30_000               # prefill role: how long KV is held for decode
    # Schedule and launch step n+1 while the GPU still runs step n (sampled tokens stay on the
    # device as the next inputs). None: on for CUDA devices, except in the prefill role.
    async_scheduling: bool | None = None
    # The garbage collector's thresholds for the engine's process (gc.set_threshold), set when
    # the engine starts; None leaves the interpreter's (DEFAULT_GC_THRESHOLD says why).
    gc_threshold: tuple[int, int, int] | None = DEFAULT_GC_THRESHOLD
    # "fcfs": arrival order; "priority": each request's `priority` first (lower sooner, vLLM's
    # `--scheduling-policy priority`), with less urgent running requests preempted to admit a
    # more urgent one (engine/request_queue.py).
    policy: SchedulingPolicy = "fcfs"
    # Load shedding (a service's AsyncEngine): requests beyond `max_num_seqs` + this many in
    # flight are refused at once (EngineOverloadedError; the workers answer RESOURCE_EXHAUSTED
    # and the gateway tries another worker, then answers 429) rather than queued without bound,
    # as SGLang's --max-queued-requests. None: unbounded.
    max_queued_requests: int | None = None

    def validate(self) -> None:
        q = self.max_queued_requests
        if q is not None and (type(q) is not int or q < 0):
            raise ConfigError(f"max_queued_requests must be an integer >= 0 or None, got {q!r}")
        if self.policy not in get_args(SchedulingPolicy):
            raise ConfigError(f"scheduling policy must be one of "
                              f"{', '.join(get_args(SchedulingPolicy))}, got {self.policy!r}")
        t = self.gc_threshold
        if t is not None and (len(t) != 3 or any(type(x) is not int or x < 0 for x in t)):
            raise ConfigError(f"gc_threshold must be three integers >= 0, got {t!r}")
