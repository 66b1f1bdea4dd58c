"""What the orchestrator runs and what it yields: a validated, tokenized request
(`GenerationJob`), and the events of its completions (`TokenDelta`, `Finished`), shared by the
REST and gRPC front doors that build the jobs and render the events; and what a job's calls
take of it: the time left of its deadline, each completion's sampling."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from engine_api.hashing import cache_salt_problem
from gateway.errors import GatewayError
from protos.splitserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class GenerationJob:
    """A validated, tokenized request: what the orchestrator runs."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams   # validated; max_tokens resolved (>= 1)
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A chat request's tool_choice when it sent tools (none, auto, required, named): the
    # output's parsing is the front door's (REST or gRPC); here it is observed (metric, span
    # attribute).
    tool_choice: str | None = None
    # The LoRA adapter it runs with (the request's `model` naming one); "": the base model.
    lora_name: str = ""
    # Scheduling priority on both workers (an int32; lower is scheduled sooner): anything but 0
    # needs workers started with --scheduling-policy priority, which the workers check.
    priority: int = 0
    # vLLM's cache_salt: the prompt's KV is hashed under a salted root on the workers (and for
    # routing here), so only requests with the same salt share cached blocks; "": none.
    cache_salt: str = ""
    # The GenAI operation it is (span name and `gen_ai.operation.name`): "chat" for a chat
    # request (chat completions, the Responses API, gRPC chat input), else "text_completion".
    operation: str = "text_completion"
    arrival_time: float = field(default_factory=time.monotonic)
    # The prompt's block hashes per KV layout (fingerprint, block size), computed once for both
    # pools and all `n` completions (WorkerPool.prompt_hashes).
    block_hashes: dict[tuple[bytes, int], list[bytes]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.HasField("logprobs")


def checked_cache_salt(salt: str | None, param: str = "cache_salt") -> str:
    """A request's `cache_salt` as a job takes it ("" for none); 400 past the workers' limits
    (`cache_salt_problem`)."""
    problem = cache_salt_problem(salt)
    if problem is not None:
        raise GatewayError.invalid(param, problem.replace("cache_salt", param, 1))
    return salt or ""


@dataclass(slots=True)
class TokenDelta:
    """New tokens of completion `index` and the text they add (may be empty: held back)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[common_pb2.TokenLogprob]
    # The prompt scored (sampling.prompt_logprobs): in completion 0's first delta only.
    prompt_logprobs: common_pb2.PromptLogprobs | None = None


@dataclass(slots=True)
class Finished:
    """Completion `index` is done."""

    index: int
    finish_reason: str                 # "stop" | "length" | "abort"
    stop_reason: str | None            # the stop string that matched, if any
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


Event = TokenDelta | Finished


def usage_totals(finished: Sequence[Finished]) -> tuple[int, int, int]:
    """(prompt_tokens, completion_tokens, cached_tokens) of one request's n completions.

    The prompt is counted once (as OpenAI and vLLM do); completion tokens are summed.
    """
    if not finished:
        return 0, 0, 0
    return (finished[0].num_prompt_tokens, sum(f.num_output_tokens for f in finished),
            max(f.num_cached_tokens for f in finished))


def time_remaining(arrival_time: float, timeout_s: float) -> float:
    """Seconds left of a request's deadline (`timeout_s` from its `arrival_time`, monotonic):
    the timeout of its next downstream call (Python gRPC does not propagate deadlines).
    DEADLINE_EXCEEDED once none are left."""
    remaining = arrival_time + timeout_s - time.monotonic()
    if remaining <= 0:
        raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"request exceeded its {timeout_s}s deadline")
    return remaining


def completion_sampling(sampling: common_pb2.SamplingParams, index: int
                        ) -> common_pb2.SamplingParams:
    """Completion `index` of n: seed + index, so seeded n > 1 completions differ; only
    completion 0 scores the prompt (prompt logprobs are the prompt's, not a completion's)."""
    if index == 0:
        return sampling
    copy = unscored(sampling, always_copy=True)
    if sampling.HasField("seed"):
        copy.seed = (sampling.seed + index) % (1 << 64)
    return copy


def unscored(sampling: common_pb2.SamplingParams, always_copy: bool = False
             ) -> common_pb2.SamplingParams:
    """`sampling` without prompt logprobs (itself when it asks for none, unless
    `always_copy`: the caller changes the copy)."""
    if not always_copy and not sampling.HasField("prompt_logprobs"):
        return sampling
    copy = common_pb2.SamplingParams()
    copy.CopyFrom(sampling)
    copy.ClearField("prompt_logprobs")
    return copy
