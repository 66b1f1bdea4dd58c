"""The shape both attention backends share: a step's attention is `write_kv` (RoPE when the
backend fuses it, and this step's K/V into the paged cache) then `attend` (attention over the
cache). `forward` runs both; piecewise CUDA graphs capture `write_kv` with the layers around it
and launch `attend` eagerly (engine/piecewise_graphs.py)."""

from __future__ import annotations

import abc

import torch

from engine.attention.forward_context import AttentionMetadata, RopeInputs


class PagedAttentionBackend(abc.ABC):
    """Mutates `kv_cache` only, and q and k when given `rope`.

    A backend with `fuses_rope` rotates q and k itself (fused with its KV write): the model then
    passes `rope` and unrotated q, k. Otherwise q and k arrive rotated and `rope` is None.
    A backend with `captures_cuda_graphs` never reads device values on the host, so a decode
    step through it can be captured in a CUDA graph."""

    name: str
    fuses_rope: bool
    captures_cuda_graphs: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float,
                kv_scale: tuple[float, float] = (1.0, 1.0), *,
                rope: RopeInputs | None = None, sliding_window: int = 0,
                logit_softcap: float = 0.0) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] → out [T, H, D]; sequences ordered decodes first.
        With `rope` (a backend that `fuses_rope`), q and k arrive unrotated and are rotated in
        place; without, already rotated. `sliding_window` and `logit_softcap`: see `attend`."""
        self.write_kv(q, k, v, kv_cache, md.slot_mapping, kv_scale, rope=rope)
        return self.attend(q, k, v, kv_cache, md, scale, kv_scale,
                           sliding_window=sliding_window, logit_softcap=logit_softcap)

    @abc.abstractmethod
    def write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: tuple[float, float] = (1.0, 1.0), *,
                 rope: RopeInputs | None = None) -> None:
        """Rotate q and k (given `rope`) and write k, v at `slot_mapping` (-1: not written);
        a quantized cache stores them under `kv_scale`."""

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata, scale: float,
               kv_scale: tuple[float, float] = (1.0, 1.0), *, sliding_window: int = 0,
               logit_softcap: float = 0.0) -> torch.Tensor:
        """Attention over the cache `write_kv` filled → [T, H, D].

        sliding_window W > 0: the query at position p sees only positions p - W < j <= p (W
        keys, itself included: Mistral's and Gemma's local layers, as `transformers` masks
        them); 0: every position <= p. logit_softcap c > 0: each scaled score s becomes
        c * tanh(s / c) before the softmax (Gemma 2); 0: none. Both are per-layer constants."""
