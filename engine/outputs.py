"""What the engine returns (mirrors vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.logprobs import PromptLogprobs, TokenLogprob
from engine.request import RequestMetrics
from engine_api.beam_search import BeamSequence


@dataclass(slots=True)
class StepOutput:
    """One request's progress in one engine step (the services stream these)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | None (prefill role: None)
    num_prompt_tokens: int
    num_cached_tokens: int
    text_delta: str = ""
    stop_reason: int | str | None = None
    kv_held: bool = False              # prefill role: prompt KV is held under a lease
    metrics: RequestMetrics | None = None  # set when finished
    # Asked for (SamplingParams.prompt_logprobs): prompt tokens 1, 2, ... each scored given the
    # ones before it, in the request's first output only.
    prompt_logprobs: PromptLogprobs | None = None
    # An embedding request's (PoolingParams): its pooled vector, in its one (finished) output.
    embedding: list[float] | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # As vLLM's: one entry per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    children_metrics: list[RequestMetrics] = field(default_factory=list)


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's `EmbeddingOutput`: one prompt's embedding (float32 values)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput`: what `LLM.embed` returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's `ClassificationOutput`: one prompt's class probabilities (sigmoid of a lone
    label's logit, else the softmax over the labels) and the logits they come from."""

    probs: list[float]
    logits: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """vLLM's `ClassificationRequestOutput`: what `LLM.classify` returns per prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's `ScoringOutput`: one pair's score (a cross-encoder's probability, or the cosine
    similarity of two embeddings)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """vLLM's `ScoringRequestOutput`: what `LLM.score` returns per pair."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's `BeamSearchOutput`: one prompt's best sequences, best first
    (engine_api/beam_search.py's `BeamSequence`: tokens, text, cum_logprob, finish_reason)."""

    sequences: list[BeamSequence]
