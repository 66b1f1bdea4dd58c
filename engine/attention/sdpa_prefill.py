"""Causal attention of a prompt with no cached prefix through torch SDPA (cuDNN / FlashAttention).

A sequence whose KV cache holds nothing before this step (`seq_len == q_len`) attends only to its
own fresh K/V, which the step already has in registers-friendly dense form; it needs no block
table. For long such prompts the vendor kernels behind `scaled_dot_product_attention` on Hopper
beat our FlashAttention-2-style Triton kernel (measured in bench/results/h200/), so the Triton
backend routes them here; chunked prefills and prefix-cache hits keep the paged Triton kernel.

`SPLITSERVE_FRESH_PREFILL=triton` turns this path off (for A/B measurements).
"""

from __future__ import annotations

import os

import torch

# Prompts shorter than this stay on the Triton kernel: per-call overhead dominates there.
MIN_FRESH_PREFILL_TOKENS = 512


def fresh_prefill_enabled() -> bool:
    """Whether the SDPA path is on (default), read when a backend is created."""
    value = os.environ.get("SPLITSERVE_FRESH_PREFILL", "sdpa").strip().lower()
    if value not in ("sdpa", "triton"):
        raise ValueError(f"SPLITSERVE_FRESH_PREFILL must be sdpa or triton, got {value!r}")
    return value == "sdpa"


def _backends() -> list[object]:
    from torch.nn.attention import SDPBackend

    # In priority order; MATH last so CPU tensors (interpreter tests) still run.
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_fresh_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (one sequence, positions 0..T-1, RoPE applied) -> [T, H, D].

    Writes and returns `out` (a view is fine) when given. Without it, returns SDPA's own output
    as a `[T, H, D]` view when that is already dense in this layout (cuDNN writes its output
    token-major like its q), saving a copy of the whole output per layer; else a dense copy.
    Grouped-query heads are expanded by SDPA (`enable_gqa`).
    """
    from torch.nn.attention import sdpa_kernel

    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D] views, no copies
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    with sdpa_kernel(_backends(), set_priority=True):  # type: ignore[arg-type]
        o = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1])
    o = o.squeeze(0).transpose(0, 1)
    if out is not None:
        return out.copy_(o)
    return o if o.is_contiguous() else o.contiguous()
