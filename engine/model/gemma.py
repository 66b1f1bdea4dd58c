"""Gemma 2 / Gemma 3's decoder layer: Llama's, with 'sandwich' norms.

    h = x + norm_post_attn(attention(norm_in(x)))
    out = h + norm_post_ff(mlp(norm_pre_ff(h)))

Everything else Gemma needs is set by the config where Llama's layer reads it: RMSNorms that
scale by (1 + w) (`GemmaRMSNorm`, also Gemma 3's q/k norms), the GELU-gated MLP, the attention
scale (query_pre_attn_scalar), each layer's sliding window and RoPE table, Gemma 2's
attention soft cap; and by the model: the embedding scale and the final logits' soft cap.
"""

from __future__ import annotations

import torch

from engine.attention.backend import PagedAttentionBackend
from engine.config import ModelConfig
from engine.model.decoder import LlamaDecoderLayer
from engine.model.layers import RotaryEmbedding, make_norm
from engine.parallel.shard import TensorShard


class GemmaDecoderLayer(LlamaDecoderLayer):
    """`post_attention_layernorm` normalises attention's output alone, before its residual add;
    `pre_feedforward_layernorm` (with that add) feeds the MLP and `post_feedforward_layernorm`
    normalises its output. The residual stream is carried as in Llama's layer: `(h, residual)`
    whose sum is the stream, the add done by the next norm that reads it."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding,
                 backend: PagedAttentionBackend, use_triton: bool,
                 shard: TensorShard = TensorShard()) -> None:
        super().__init__(cfg, layer_idx, rope, backend, use_triton, shard)
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, use_triton)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, use_triton)

    def mlp_block(self, h: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: attention's output after the O projection (summed over tensor-parallel ranks).
        Returns (the MLP's normalised output, the stream before it)."""
        h = self.post_attention_layernorm(h)  # type: ignore[assignment]
        out, residual = self.norm_and_mlp(self.pre_feedforward_layernorm, h, residual)
        return self.post_feedforward_layernorm(out), residual  # type: ignore[return-value]
