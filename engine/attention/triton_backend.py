"""Triton attention over the paged KV cache (GPU; CPU only under TRITON_INTERPRET=1).

One step: rotate q and k (RoPE) and write this step's K/V into the blocks in one fused kernel,
then split-K decode attention for the leading single-token sequences and varlen causal prefill
attention for the rest; each long prompt with nothing cached goes through torch SDPA instead
(prefill_plan.py, sdpa_prefill.py). A speculative verify step laid out with the same number of
query tokens per sequence goes to the decode kernel whole: one program per KV head reads each
tile once for all its query rows, split over the context. No host syncs, so pure-decode and
verify steps can be captured in CUDA graphs.
A quantized (fp8 or int8) cache passes the layer's K/V scales to the kernels as Python floats
(constant per engine, so baked into captured graphs); a layer's sliding window and logit soft
cap are compile-time constants of the kernels (a windowed model compiles two variants: its
local and its global layers'). A fresh prompt whose attention SDPA cannot express (a window
shorter than the prompt, capped scores) goes to the paged kernel in that layer.
"""

from __future__ import annotations

import os

import torch

from engine.attention.backend import PagedAttentionBackend
from engine.attention.forward_context import AttentionMetadata, RopeInputs
from engine.attention.kv_quant import is_quantized
from engine.attention.prefill_plan import plan_prefill
from engine.attention.prefill_run import PrefillRun
from engine.attention.sdpa_prefill import (
    MIN_FRESH_PREFILL_TOKENS,
    fresh_prefill_enabled,
    sdpa_fresh_prefill,
)


class TritonAttentionBackend(PagedAttentionBackend):
    """GPU backend; a quantized cache uses the layer's `kv_scale` (k_scale, v_scale). Fuses RoPE
    into the KV write: given `rope`, it rotates q and k (in place) itself."""

    name = "triton"
    fuses_rope = True
    captures_cuda_graphs = True

    def __init__(self) -> None:
        from engine import kernels

        self._k = kernels
        self._fresh_prefill_sdpa = fresh_prefill_enabled()
        self._verify_by_decode_kernel = verify_by_decode_kernel()

    def write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: tuple[float, float] = (1.0, 1.0), *,
                 rope: RopeInputs | None = None) -> None:
        """The first half of `forward`: rotate q and k in place (given `rope`) and write k, v
        at `slot_mapping` (-1: a padding row, not written). Reads no step layout from the host,
        so piecewise CUDA graphs capture it."""
        ks, vs = kv_scale if is_quantized(kv_cache) else (None, None)
        if rope is None:
            self._k.write_kv(k, v, kv_cache, slot_mapping, ks, vs)
        else:
            self._k.rotary_and_write_kv(rope.positions, q, k, v, rope.cos_sin_cache, kv_cache,
                                        slot_mapping, ks, vs, is_neox=rope.is_neox)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata, scale: float,
               kv_scale: tuple[float, float] = (1.0, 1.0), *, sliding_window: int = 0,
               logit_softcap: float = 0.0) -> torch.Tensor:
        """The second half of `forward`: attention over the cache `write_kv` filled (k and v
        are read too: a fresh prompt's SDPA path attends to them directly)."""
        kern = self._k
        ks: float | None = None
        vs: float | None = None
        if is_quantized(kv_cache):
            ks, vs = kv_scale
        if md.uniform_query_len > 1 and self._verify_by_decode_kernel:
            # A verify step: the split decode kernel, uniform_query_len rows per sequence.
            return kern.paged_decode_attention(
                q, kv_cache, md.block_tables, md.seq_lens, scale, max_seq_len=md.max_seq_len,
                k_scale=ks, v_scale=vs, query_len=md.uniform_query_len,
                sliding_window=sliding_window, logit_softcap=logit_softcap)
        nd = md.num_decodes
        runs = md.prefill_plan
        if runs is None:
            # With a quantized cache too: a fresh prompt then attends to its exact K/V, as SGLang's
            # ragged prefill does; its later decodes and chunks read the quantized cache.
            runs = md.prefill_plan = plan_prefill(
                md, MIN_FRESH_PREFILL_TOKENS if self._fresh_prefill_sdpa else None)

        def by_sdpa(run: PrefillRun) -> bool:
            # Causal SDPA is this layer's attention unless scores are capped or the window
            # hides part of the prompt from its last tokens.
            return run.sdpa and logit_softcap == 0.0 and (
                sliding_window == 0 or run.max_query_len <= sliding_window)

        if nd == 0 and len(runs) == 1 and by_sdpa(runs[0]):
            return sdpa_fresh_prefill(q, k, v, None, scale)  # one fresh prompt: SDPA's own output
        out = torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        if nd > 0:
            kern.paged_decode_attention(q[:nd], kv_cache, md.block_tables[:nd], md.seq_lens[:nd],
                                        scale, out=out[:nd], max_seq_len=md.max_seq_len,
                                        k_scale=ks, v_scale=vs, sliding_window=sliding_window,
                                        logit_softcap=logit_softcap)
        for run in runs:
            a, b = run.token_start, run.token_end
            if by_sdpa(run):
                sdpa_fresh_prefill(q[a:b], k[a:b], v[a:b], out[a:b], scale)
            else:
                kern.paged_prefill_attention(
                    q[a:b], kv_cache, run.query_start_loc, md.seq_lens[run.first:run.last],
                    md.block_tables[run.first:run.last], scale, run.max_query_len,
                    out=out[a:b], k_scale=ks, v_scale=vs, sliding_window=sliding_window,
                    logit_softcap=logit_softcap)
        return out


def verify_by_decode_kernel() -> bool:
    """Whether verify steps take the split decode kernel (default) rather than the paged prefill
    kernel (`SPLITSERVE_VERIFY_ATTENTION=prefill`, for A/Bs); read when a backend is created."""
    value = os.environ.get("SPLITSERVE_VERIFY_ATTENTION", "decode").strip().lower()
    if value not in ("decode", "prefill"):
        raise ValueError(f"SPLITSERVE_VERIFY_ATTENTION must be decode or prefill, got {value!r}")
    return value == "decode"
