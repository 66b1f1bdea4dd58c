"""Per-request pooling parameters of an embedding request, validated at construction (mirrors
vLLM's `PoolingParams`). Torch-free: the gateway validates with them too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from engine_api.errors import ConfigError
from engine_api.sampling_params import check_truncation

# How an embedding request's hidden states become one vector (engine/pooling.py): the last
# prompt position's (decoder embedding models: Qwen3-Embedding, e5-mistral), the mean over the
# prompt's positions, or the first position's (BERT's [CLS]).
PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = get_args(PoolingType)


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """The engine's default pooling for embedding requests, over the model's own (its
    sentence-transformers files, engine/pooler.py; LAST and normalized without them), as vLLM's
    `--override-pooler-config`. None: the model's."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    # vLLM's `classifier_from_token`: classify with the LM head's rows for these tokens (each
    # one token; two [no, yes] as one yes-minus-no logit: engine/classifier.py). Empty: none.
    classifier_from_token: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                              f"{self.pooling_type!r}")
        tokens = self.classifier_from_token
        if any(not isinstance(t, str) or not t for t in tokens) or len(set(tokens)) != len(tokens):
            raise ConfigError(f"classifier_from_token must be distinct non-empty tokens, got "
                              f"{list(tokens)!r}")



class PoolingParamsError(ValueError):
    """An invalid pooling parameter; the message names the field and the allowed range."""


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How one prompt's hidden states become its embedding (engine/pooling.py).

    `pooling_type` and `normalize`: None takes the engine's (`LLMEngine.pooler`: the model's
    sentence-transformers configuration, or LAST + normalized). `dimensions`: keep the first
    this many features (Matryoshka truncation), renormalized when `normalize`; None: all of
    them (the model's hidden size, the upper bound the engine checks)."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    # As `SamplingParams.truncate_prompt_tokens`: keep the prompt's last this many tokens.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise PoolingParamsError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                     f"got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingParamsError(f"normalize must be true or false, got {self.normalize!r}")
        dims = self.dimensions
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
            raise PoolingParamsError(f"dimensions must be an integer >= 1, got {dims!r}")
        check_truncation(self.truncate_prompt_tokens, PoolingParamsError)

    def resolved(self, default: PoolerConfig, hidden_size: int) -> PoolingParams:
        """These parameters with every field set: unset ones from `default` (whose fields are
        all set), `dimensions` checked against the model's `hidden_size`."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise PoolingParamsError(f"dimensions must be at most {hidden_size} (the model's "
                                     f"embedding size), got {self.dimensions}")
        return dataclasses.replace(
            self, pooling_type=self.pooling_type or default.pooling_type,
            normalize=default.normalize if self.normalize is None else self.normalize,
            dimensions=self.dimensions or hidden_size)
