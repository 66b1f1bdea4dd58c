"""Sequence classification and cross-encoder scoring over a decoder, as vLLM serves it: a pooled
final hidden state (engine/pooling.py; LAST for these models) times a matrix of one row per label.

The matrix comes from one of two places:

- a `*ForSequenceClassification` checkpoint's `score.weight` (transformers' classifier heads;
  reward models, mxbai-rerank-v2-style rerankers): its labels are the config's `id2label`;
- the LM head's rows for a few tokens (vLLM's `classifier_from_token`), for rerankers trained
  as causal LMs that answer "yes" or "no" (Qwen3-Reranker, bge-reranker-v2-gemma). Two tokens
  [no, yes] make one label whose logit is logit(yes) - logit(no): its sigmoid is the softmax
  of the two (vLLM's `from_2_way_softmax`). Any other count keeps one label per token.

The product is computed on the host, in float32, on the float32 pooled vector: [labels, hidden]
is small beside anything a step does on the device. Probabilities (`probabilities`) are the
sigmoid of a single label's logit, else the softmax of all of them (transformers' convention for
`num_labels == 1` regression-style heads and for single-label classification).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Classifier:
    """`weight` [len(labels), hidden] float32 on the CPU."""

    weight: torch.Tensor
    labels: tuple[str, ...]

    def logits(self, pooled: Sequence[float]) -> list[float]:
        """The labels' logits for one pooled hidden state."""
        import torch

        vec = torch.tensor(pooled, dtype=torch.float32)
        return [float(x) for x in self.weight @ vec]


def head_classifier(cfg: ModelConfig, score_weight: torch.Tensor) -> Classifier:
    """A `*ForSequenceClassification` checkpoint's head, as loaded into the model."""
    return Classifier(score_weight.detach().float().cpu().clone(), cfg.class_labels)


def token_classifier(cfg: ModelConfig, lm_head_weight: torch.Tensor, token_ids: Sequence[int],
                     tokens: Sequence[str]) -> Classifier:
    """vLLM's `classifier_from_token`: the LM head's rows for `token_ids` (the ids of `tokens`,
    each one token), two of them [no, yes] folded into one yes-minus-no label. ConfigError where
    the logits are not a linear function of the hidden state (Gemma 2's final soft cap)."""
    if cfg.final_logit_softcapping > 0:
        raise ConfigError("classifier_from_token: this model's logits are soft-capped, so a "
                          "label's logit is not a row of the LM head times the hidden state")
    if len(token_ids) != len(tokens) or not tokens:
        raise ConfigError("classifier_from_token needs one id per token, at least one")
    rows = lm_head_weight.detach()[list(token_ids)].float().cpu()
    if len(tokens) == 2:
        return Classifier((rows[1] - rows[0]).unsqueeze(0).clone(), (tokens[1],))
    return Classifier(rows.clone(), tuple(tokens))
