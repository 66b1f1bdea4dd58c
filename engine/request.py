"""One sequence's life inside the engine (pure Python: the scheduler and KV manager use it)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.logprobs import PromptLogprobs, TokenLogprob
from engine_api.pooling_params import PoolingParams
from engine_api.request_options import RemoteKv
from engine_api.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured import RequestGrammar


class RequestStatus(enum.IntEnum):  # IntEnum: C-level hashing on the per-step hot path
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode role: blocks allocated, KV being pulled
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Prefill role: the first token is sampled and the prompt KV is held under a lease.
    FINISHED_PREFILL = enum.auto()
    # An embedding request: its prompt is computed and pooled (no token is sampled).
    FINISHED_POOLED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_PREFILL,
                       RequestStatus.FINISHED_POOLED})
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class PoolingState:
    """An embedding request's pooling (engine/pooling.py): its parameters (resolved: every field
    set), how many of its prompt positions are planned (their rows launched: each is pooled
    once, across preemptions, as prompt logprobs are), and the float32 sum on the host of the
    hidden states pooled so far.

    Every pooling type sums hidden states over a span of prompt positions (`positions`): MEAN
    all of them (divided by their number at the end), LAST the last one, CLS the first one."""

    params: PoolingParams
    num_prompt_tokens: int
    num_planned: int = 0
    total: object | None = None  # torch.Tensor [hidden_size] float32 (request.py is torch-free)

    @property
    def positions(self) -> tuple[int, int]:
        """[first, end) of the prompt positions pooled."""
        n = self.num_prompt_tokens
        kind = self.params.pooling_type
        return (n - 1, n) if kind == "LAST" else (0, 1) if kind == "CLS" else (0, n)

    @property
    def needs_own_prompt(self) -> bool:
        """Positions still to pool may be ones a prefix-cache hit would skip (never the last,
        which is always computed): until they are planned the prompt is computed here."""
        return self.params.pooling_type != "LAST" and self.num_planned < self.positions[1]


@dataclass(slots=True)
class RequestMetrics:
    """perf_counter timestamps (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


class Request:
    """A sequence: prompt, generated tokens, KV progress and sampling state."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int | None = None,
        output_token_ids: list[int] | None = None,
        remote_kv: RemoteKv | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # Scheduling priority (engine/request_queue.py; lower is sooner) and the scheduler's
        # admission counter, which orders requests of equal priority and arrival time.
        self.priority = priority
        self.queue_seq = 0
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # Tokens already produced elsewhere (decode role: the first token from prefill; resume).
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Sampled tokens launched on the device but not yet appended (async scheduling: at most
        # 2, between scheduling step n+1 and processing step n).
        self.num_inflight = 0
        self.num_cached_tokens = -1  # prompt tokens served by the prefix cache; -1 = unknown yet
        self.block_hashes: list[bytes] = []
        # The LoRA adapter it runs (its slot in the runner's `LoRAStack`; 0: the base model) and
        # the root its block hashes chain from (None: the engine's; an adapter's KV differs).
        self.lora_slot = 0
        self.hash_root: bytes | None = None
        self.status = RequestStatus.WAITING
        self.remote_kv = remote_kv
        # Run to its end on a prefill-role engine instead of finishing at its first token with
        # its prompt KV leased for a decode worker (RequestOptions.decode_here).
        self.decode_here = False
        self.num_preemptions = 0
        self.logprobs: list[TokenLogprob] = []
        # Prompt logprobs (engine/prompt_logprobs.py): those of prompt tokens 1, 2, ... that
        # reached the host, how many are launched, and whether any are still to be launched
        # (until then the prompt is computed here: no prefix-cache hits, no remote KV).
        self.prompt_logprobs = PromptLogprobs(sampling_params.prompt_logprobs or 0)
        self.num_prompt_logprobs_planned = 0
        self.prompt_logprobs_sent = False  # carried out by the request's first StepOutput
        self.scores_prompt = (sampling_params.prompt_logprobs is not None
                              and len(self.prompt_token_ids) > 1)
        # An embedding request (engine/pooling.py): its prompt is pooled, no token sampled.
        self.pooling: PoolingState | None = None
        self.metrics = RequestMetrics(arrival_time if arrival_time is not None else time.perf_counter())
        self.stop_reason: int | str | None = None
        # Seeded sampling state lives with the request so batching does not change its draws.
        self.generator: object | None = None
        # Its logit bias and allowed token ids as device tensors, made on first use
        # (engine/sampler.py `ShapingTensors`): not rebuilt from Python lists every step.
        self.shaping_tensors: object | None = None
        # Its place in `structured_outputs`' language (engine/structured.py); None: free text.
        self.grammar: RequestGrammar | None = None
        # `bad_words` as token sequences (engine/bad_words.py), set when it is queued.
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
        # Speculative decoding (engine/spec/): drafts per step at most (0: off), the drafts
        # proposed for the next step, and what verification made of them.
        self.num_speculative_tokens = 0
        self.spec_method = "none"  # the engine's proposer that drafts for it (SpecMethod)
        # The worker's cap for the next proposal (engine/spec/budget.py; -1: none set) and the
        # request's class as the gateway saw it (acceptance is measured per method and class).
        self.spec_step_k = -1
        self.spec_class = ""
        # Drafts a shadow proposal may have (the engine's cap; 0: its sampling cannot
        # speculate): engine/spec/shadow.py.
        self.spec_shadow_k = 0
        self.spec_fixed = False  # the step budget leaves its drafts at its cap
        self.spec_token_ids: list[int] = []
        # A draft model's distributions of those drafts when it sampled them ([k, V] tensor on
        # the device; None: the drafts are deterministic).
        self.spec_draft_probs: object | None = None
        self.spec_sync_in = 0  # steps left to overlap before the proposer looks again
        # Moving averages of the drafts accepted per verify step, over about four steps and
        # about twenty (engine/spec/__init__.py; optimistic start).
        self.spec_accepted_avg = float("inf")
        self.spec_accepted_long_avg = float("inf")
        self.spec_resume_at = 0  # no drafts before the sequence has this many tokens
        self.spec_pause_tokens = 0  # the last pause's length while paused again and again
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def computes_whole_prompt(self) -> bool:
        """No prefix-cache hit may skip a prompt position: each is still to be scored (prompt
        logprobs) or pooled (MEAN, CLS)."""
        return self.scores_prompt or (self.pooling is not None and self.pooling.needs_own_prompt)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def max_output_tokens(self) -> int:
        """Output tokens allowed by max_tokens and by the context length."""
        limit = self.sampling_params.max_tokens
        ctx_left = (self.max_model_len - self.num_prompt_tokens) if self.max_model_len else None
        if limit is None:
            return ctx_left if ctx_left is not None else 2**31
        return min(limit, ctx_left) if ctx_left is not None else limit

    def check_stop(self) -> RequestStatus | None:
        """Stop condition after a token was appended (stop strings are the detokenizer's)."""
        sp = self.sampling_params
        n_out = self.num_output_tokens
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if self.grammar is not None:
            if self.grammar.failed:  # no allowed token was left to sample (see there)
                return RequestStatus.FINISHED_ABORTED
            if self.grammar.is_terminated:  # the string is complete and its EOS accepted
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_output_tokens():
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, {self.status.name})")
