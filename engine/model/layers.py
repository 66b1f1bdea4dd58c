"""Building blocks: linear layers, RMSNorm (Llama's and Gemma's), rotary embedding (plain /
linear / llama3 scaling), the gated MLP's activations (SiLU, GELU tanh).

Each op has a torch path (the reference, bit-compatible with Hugging Face's Llama) and, where
`use_triton` is set, a fused Triton kernel from `engine.kernels`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig


def gemv_enabled() -> bool:
    """`SPLITSERVE_GEMV` (default 1): one-row matmuls of the Triton path run through the Triton
    GEMV, with the RMSNorms folded in (engine/kernels/gemv.py). `0` sends them to cuBLAS.

    On by default since the fused path measured 4.41 ms batch-1 ITL against 4.67 ms through
    cuBLAS on the H200, before its tile sweep (bench/results/h200/ab_latency_g*_5333eb4.json).
    Int8 weights take the same path (`gemv_operands` hands the kernel their scales)."""
    value = os.environ.get("SPLITSERVE_GEMV", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"SPLITSERVE_GEMV must be 0 or 1, got {value!r}")
    return value == "1"


class Linear(nn.Linear):
    """`nn.Linear` whose one-row inputs (batch-1 decode) run through the Triton GEMV when
    `use_gemv` is set (engine/kernels/gemv.py). The weight layout and `load_weights` are
    unchanged.

    Its parameters start uninitialised: a model's are all loaded or filled right after it is
    built (`LlamaForCausalLM.load_weights` / `init_dummy_weights` check or cover every one), and
    `nn.Linear`'s random init of weights about to be overwritten took a second of SmolLM2's
    start on a 2-core CPU."""

    def reset_parameters(self) -> None:
        pass

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 use_gemv: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.use_gemv = use_gemv

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, bias, weight_scale) for the batch-1 GEMV kernels (no scale: float weights;
        `engine.model.quant.Int8Linear` has the same method)."""
        return self.weight, self.bias, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gemv and x.dim() == 2 and x.shape[0] == 1:
            from engine.kernels.gemv import gemv
            return gemv(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    # x / rms(x) rounded to the activation dtype before the weight multiply (transformers'
    # Llama order); Gemma's norms multiply in float32 and round once.
    round_before_weight = True

    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D]. With `residual`: returns (norm(x + residual), x + residual)."""
        if self.use_triton:
            from engine.kernels import rms_norm
            return rms_norm(x, self.weight, self.eps, residual=residual,
                            round_before_weight=self.round_before_weight)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), multiplied in float32 and rounded once after.

    The parameter holds `1 + w` (`load_weights` adds the one: `stored_weight`), so every
    fused kernel of `RMSNorm` (Triton `rms_norm`, the batch-1 `rms_norm_gemv` fold) works
    unchanged, and it stays float32 whatever the model's dtype: float32 is what transformers
    computes `1 + w.float()` in, so the stored value is exactly its. Rounded to bf16 it would
    lose w's low bits (bf16 spacing near 1 is 2^-7). The Triton `rms_norm` multiplies in float32
    too (`round_before_weight` off), so a bf16 row is rounded once, after, as in transformers."""

    round_before_weight = False

    @staticmethod
    def stored_weight(checkpoint_weight: torch.Tensor) -> torch.Tensor:
        """The parameter's value for a checkpoint's `w`: 1 + w in float32."""
        return 1.0 + checkpoint_weight.float()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> GemmaRMSNorm:
        # `model.to(dtype)` goes through here: the weight follows device moves only.
        before = self.weight.data
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = before.to(self.weight.device)
        return self

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        return out if residual is None else (out, residual)


def make_norm(cfg: ModelConfig, size: int, use_triton: bool) -> RMSNorm:
    """The architecture's RMSNorm over `size` features (Gemma's for Gemma)."""
    cls = GemmaRMSNorm if cfg.is_gemma else RMSNorm
    return cls(size, cfg.rms_norm_eps, use_triton)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the position scale factor, as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; supported: default, "
                      "linear, llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) with a precomputed cos/sin cache [max_pos, D].

    `forward` is the torch path (the reference backend); the Triton backend reads the table and
    rotates inside its fused RoPE + KV-write kernel (`PagedAttentionBackend.fuses_rope`)."""

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self._args = (head_dim, max_position, theta, scaling)
        self.register_buffer("cos_sin_cache", self._table(), persistent=False)
        self.head_dim = head_dim

    def _table(self, device: torch.device | None = None) -> torch.Tensor:
        head_dim, max_position, theta, scaling = self._args
        inv_freq, _ = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                      # [max_pos, D/2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)  # [max_pos, D]: cos | sin

    def rebuild_fp32(self) -> None:
        """Recompute the table in float32 (after `model.to(bf16)` rounded it)."""
        self.cos_sin_cache = self._table(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H, D]; k: [T, Hkv, D]."""
        cos_sin = self.cos_sin_cache[positions]
        half = self.head_dim // 2
        cos = torch.cat([cos_sin[:, :half]] * 2, dim=-1)[:, None, :].to(q.dtype)
        sin = torch.cat([cos_sin[:, half:]] * 2, dim=-1)[:, None, :].to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """x: [T, 2I] → silu(x[:, :I]) * x[:, I:]: [T, I]."""
    return act_and_mul(x, "silu", use_triton)


def act_and_mul(x: torch.Tensor, act: str, use_triton: bool = False) -> torch.Tensor:
    """x: [T, 2I] → act(x[:, :I]) * x[:, I:]: [T, I], `act` a `ModelConfig.hidden_act`: SiLU,
    or GELU with transformers' `gelu_pytorch_tanh` (tanh approximation)."""
    if use_triton:
        from engine import kernels
        fused = kernels.silu_and_mul if act == "silu" else kernels.gelu_tanh_and_mul
        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    if act == "silu":
        return nn.functional.silu(gate) * up
    return nn.functional.gelu(gate, approximate="tanh") * up
