"""A classifier's label probabilities from its logits (the engine's `LLM.classify` and the
gateway's /v1/classify and cross-encoder /v1/score compute them the same way)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def probabilities(logits: Sequence[float]) -> list[float]:
    """sigmoid of a lone logit, else softmax (max-shifted, in float64)."""
    if len(logits) == 1:
        x = logits[0]
        return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]
