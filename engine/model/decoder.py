"""The Llama-family decoder layer: attention (QKV, RoPE + KV write, paged attention, O
projection) and the MLP (or a mixture of experts), each with its LoRA deltas.

Its own module, below `llama.py` (the whole model) and `gemma.py` (Gemma's layer subclasses
this one): the model picks either layer class, and neither layer imports the model.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.attention.backend import PagedAttentionBackend
from engine.attention.forward_context import (
    AttentionMetadata,
    RopeInputs,
    current_lora,
    get_forward_context,
)
from engine.attention.kv_channels import LayerChannelFactors
from engine.config import ModelConfig
from engine.model.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    act_and_mul,
    gemv_enabled,
    make_norm,
)
from engine.model.moe import SparseMoeBlock
from engine.parallel.group import all_reduce_
from engine.parallel.shard import TensorShard


def _with_lora(layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y = the base projection `fused` of x, plus the step's LoRA deltas on their rows."""
    lora = current_lora()
    if lora is None:
        return y
    stack, batch = lora
    return stack.apply(layer, fused, x, y, batch)


def _one_row_fused(use_gemv: bool, x: torch.Tensor) -> bool:
    """Whether a one-row batch folds its RMSNorm into the projection's GEMV: not when a LoRA
    adapter runs in the step (its delta needs the normalised input)."""
    return use_gemv and x.shape[0] == 1 and current_lora() is None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding,
                 backend: PagedAttentionBackend, use_triton: bool = False,
                 shard: TensorShard = TensorShard()) -> None:
        """cfg: this rank's architecture (`shard_model_config`: its heads and KV heads)."""
        super().__init__()
        self.reduce = shard.is_split  # the row-parallel projection's output: a partial sum
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.layer_window(layer_idx)  # 0: full attention
        self.logit_softcap = cfg.attn_logit_softcapping    # 0: none
        use_gemv = use_triton and gemv_enabled()
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               cfg.attention_bias, use_gemv)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, use_gemv)
        # Qwen3, Gemma 3: each head of q and k normalised over head_dim (one weight shared by
        # the heads) before RoPE.
        self.q_norm = make_norm(cfg, self.head_dim, use_triton) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.head_dim, use_triton) if cfg.qk_norm else None
        self.rope = rope
        self.backend = backend
        # An int8 cache's per-channel factors (engine/attention/kv_channels.py), set once its
        # calibration is known; applied only over int8 caches (a float scratch cache, as the
        # calibration pass itself uses, stores K/V as they are).
        self.kv_channels: LayerChannelFactors | None = None

    def _channels_for(self, kv_cache: torch.Tensor) -> LayerChannelFactors | None:
        return self.kv_channels if kv_cache.dtype == torch.int8 else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                md: AttentionMetadata | None = None) -> torch.Tensor:
        """x: [T, hidden]. `md`: this batch's metadata when it is not the forward context's
        (one micro-batch of an overlapped step)."""
        return self.attend(positions, self.project_qkv(x), md)

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """The fused QKV projection of the normalised input (with the step's LoRA deltas)."""
        return _with_lora(self.layer_idx, "qkv_proj", h, self.qkv_proj(h))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               md: AttentionMetadata | None = None) -> torch.Tensor:
        """The rest of `forward` after the QKV projection: RoPE + KV write, attention, O."""
        return self.project_output(self.attention_output(positions, qkv, md))

    def project_output(self, o: torch.Tensor) -> torch.Tensor:
        """The O projection of attention's output (with the step's LoRA deltas), summed over the
        tensor-parallel ranks."""
        out = _with_lora(self.layer_idx, "o_proj", o, self.o_proj(o))
        return all_reduce_(out) if self.reduce else out

    def attention_output(self, positions: torch.Tensor, qkv: torch.Tensor,
                         md: AttentionMetadata | None = None) -> torch.Tensor:
        """RoPE + KV write and attention over the paged cache: [T, heads * head_dim], before the
        O projection. The part of a layer that reads the step's metadata."""
        ctx = get_forward_context()
        md = ctx.attn_metadata if md is None else md
        kv_cache = ctx.kv_caches[self.layer_idx]
        kv_scale = ctx.kv_scale(self.layer_idx)
        q, k, v = self.rotate_and_write_kv(positions, qkv, kv_cache, md.slot_mapping, kv_scale)
        return self.attend_cached(q, k, v, kv_cache, md, kv_scale)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views [T, H, D], [T, Hkv, D], [T, Hkv, D] of a fused QKV projection [T, q + 2 kv]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(-1, self.num_heads, self.head_dim),
                k.reshape(-1, self.num_kv_heads, self.head_dim),
                v.reshape(-1, self.num_kv_heads, self.head_dim))

    def rotate_and_write_kv(self, positions: torch.Tensor, qkv: torch.Tensor,
                            kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_scale: tuple[float, float]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE on q and k and k, v into the cache at `slot_mapping`; returns (q, k, v) rotated:
        views of `qkv` rotated in place when the backend fuses RoPE, new tensors otherwise.
        Over an int8 cache with channel factors, q, k, v are scaled by them first (in place:
        v stays a view of `qkv`); `attend_cached` scales the output back.
        Reads nothing else of the step, so piecewise CUDA graphs capture it with the layers."""
        q, k, v = self.split_qkv(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            q = self._head_norm(self.q_norm, q)
            k = self._head_norm(self.k_norm, k)
        channels = self._channels_for(kv_cache)
        if channels is not None:  # K's factors are equal across RoPE pairs: before RoPE is fine
            q, k, v = channels.scale_qkv(q, k, v)
        rope: RopeInputs | None = None
        if self.backend.fuses_rope:  # RotaryEmbedding is neox style
            rope = RopeInputs(positions, self.rope.cos_sin_cache, is_neox=True)
        else:
            q, k = self.rope(positions, q, k)
        self.backend.write_kv(q, k, v, kv_cache, slot_mapping, kv_scale, rope=rope)
        return q, k, v

    @staticmethod
    def _head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head of x [T, H, D] over D: a new contiguous [T, H, D]. With one
        head (k of a multi-query model, or of a tensor-parallel rank) the reshape of a slice of
        the fused QKV output is still a strided view: the Triton norm needs its rows dense."""
        t, h, d = x.shape
        return cast(torch.Tensor, norm(x.reshape(t * h, d).contiguous())).view(t, h, d)

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, md: AttentionMetadata,
                      kv_scale: tuple[float, float]) -> torch.Tensor:
        """Attention after `rotate_and_write_kv`: [T, heads * head_dim]."""
        o = self.backend.attend(q, k, v, kv_cache, md, self.scale, kv_scale,
                                sliding_window=self.sliding_window,
                                logit_softcap=self.logit_softcap)
        channels = self._channels_for(kv_cache)
        if channels is not None:
            o = channels.scale_output(o)
        return o.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, use_triton: bool, use_gemv: bool | None = None,
                 shard: TensorShard = TensorShard(), layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.reduce = shard.is_split
        self.use_gemv = use_triton and gemv_enabled() if use_gemv is None else use_gemv
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                   self.use_gemv)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                self.use_gemv)
        self.use_triton = use_triton
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A one-row batch in the model never gets here with the GEMV on: the decoder layer runs
        # norm + gate/up + activation as one kernel (`norm_and_mlp`) and calls `project_down`.
        gate_up = _with_lora(self.layer_idx, "gate_up_proj", x, self.gate_up_proj(x))
        return self.project_down(act_and_mul(gate_up, self.act, self.use_triton))

    def project_down(self, act: torch.Tensor) -> torch.Tensor:
        """The down projection (with the step's LoRA deltas), summed over the tensor-parallel
        ranks."""
        out = _with_lora(self.layer_idx, "down_proj", act, self.down_proj(act))
        return all_reduce_(out) if self.reduce else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding,
                 backend: PagedAttentionBackend, use_triton: bool,
                 shard: TensorShard = TensorShard()) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rope, backend, use_triton, shard)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, use_triton, shard) if cfg.is_sparse_layer(layer_idx)
            else LlamaMLP(cfg, use_triton, shard=shard, layer_idx=layer_idx))
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, use_triton)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, use_triton)
        # Batch-1 rows fold each RMSNorm into the projection after it (one GEMV kernel reads
        # the residual stream, normalises and streams the weight: engine/kernels/gemv.py).
        self.use_gemv = use_triton and gemv_enabled()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attention_block(positions, x, residual)
        return self.mlp_block(h, residual)

    def attention_block(self, positions: torch.Tensor, x: torch.Tensor,
                        residual: torch.Tensor | None, md: AttentionMetadata | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (+ residual add), QKV, RoPE + KV write, attention, O projection."""
        if _one_row_fused(self.use_gemv, x):
            from engine.kernels.gemv import rms_norm_gemv
            norm = self.input_layernorm
            weight, bias, scale = self.self_attn.qkv_proj.gemv_operands()
            qkv, residual = rms_norm_gemv(x, norm.weight, norm.eps, weight, bias,
                                          residual=residual, weight_scale=scale)
            return self.self_attn.attend(positions, qkv, md), residual
        qkv, residual = self.qkv_block(x, residual)
        return self.self_attn.attend(positions, qkv, md), residual

    def qkv_block(self, x: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (+ residual add) and the QKV projection, for more than one row: what a
        layer computes before attention. Returns (qkv, residual)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)  # type: ignore[misc]
        return self.self_attn.project_qkv(h), residual  # type: ignore[arg-type]

    def post_attention_block(self, o: torch.Tensor, residual: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer computes after attention: the O projection, then `mlp_block`."""
        return self.mlp_block(self.self_attn.project_output(o), residual)

    def mlp_block(self, h: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-attention norm (+ residual add), gate/up, activation-and-mul, down (or the
        experts). h: attention's output after the O projection."""
        return self.norm_and_mlp(self.post_attention_layernorm, h, residual)

    def norm_and_mlp(self, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm(h + residual)` into the MLP: returns (MLP output, h + residual). A one-row
        batch folds the norm and the activation into the gate/up GEMV."""
        if isinstance(self.mlp, LlamaMLP) and _one_row_fused(self.use_gemv, h):
            from engine.kernels.gemv import rms_norm_gemv
            weight, bias, scale = self.mlp.gate_up_proj.gemv_operands()
            act, residual = rms_norm_gemv(h, norm.weight, norm.eps, weight, bias,
                                          residual=residual, gated=True, weight_scale=scale,
                                          activation=self.mlp.act)
            return self.mlp.project_down(act), residual
        h, residual = norm(h, residual)  # type: ignore[misc]
        return self.mlp(h), residual
