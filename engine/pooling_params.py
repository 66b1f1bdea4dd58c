"""Per-request pooling parameters of an embedding request, validated at construction (mirrors
vLLM's `PoolingParams`). Torch-free: the gateway validates with them too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config import POOLING_TYPES, PoolerConfig, PoolingType
from engine.sampling_params import check_truncation


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
