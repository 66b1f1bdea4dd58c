"""Triton attention over the paged KV cache (GPU; CPU only under TRITON_INTERPRET=1).

One step: rotate q and k (RoPE) and write this step's K/V into the blocks in one fused kernel,
then split-K decode attention for the leading single-token sequences and varlen causal prefill
attention for the rest (a step whose prefills are all long and have nothing cached, as the
runner marks in `fresh_prefill_len`, goes through torch SDPA instead: sdpa_prefill.py). No host
syncs, so a pure-decode step can be captured in a CUDA graph.
An fp8 cache passes the layer's K/V scales to the kernels as Python floats (constant per engine,
so baked into captured graphs).
"""

from __future__ import annotations

import torch

from engine.attention.forward_context import AttentionMetadata, RopeInputs
from engine.attention.kv_quant import is_fp8
from engine.attention.sdpa_prefill import (
    MIN_FRESH_PREFILL_TOKENS,
    fresh_prefill_enabled,
    sdpa_fresh_prefill,
)


class TritonAttentionBackend:
    """GPU backend; an fp8 cache uses the layer's `kv_scale` (k_scale, v_scale). Fuses RoPE
    into the KV write: given `rope`, it rotates q and k (in place) itself."""

    name = "triton"
    fuses_rope = True

    def __init__(self) -> None:
        from engine import kernels

        self._k = kernels
        self._fresh_prefill_sdpa = fresh_prefill_enabled()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float,
                kv_scale: tuple[float, float] = (1.0, 1.0), *,
                rope: RopeInputs | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] → out [T, H, D]. Sequences are ordered decodes first.

        With `rope`, q and k arrive unrotated and are rotated in place; without, already rotated."""
        kern = self._k
        ks: float | None = None
        vs: float | None = None
        if is_fp8(kv_cache):
            ks, vs = kv_scale
        if rope is None:
            kern.write_kv(k, v, kv_cache, md.slot_mapping, ks, vs)
        else:
            kern.rotary_and_write_kv(rope.positions, q, k, v, rope.cos_sin_cache, kv_cache,
                                     md.slot_mapping, ks, vs, is_neox=rope.is_neox)
        nd = md.num_decodes
        num_seqs = md.seq_lens.shape[0]
        fresh_sdpa = (nd < num_seqs and self._fresh_prefill_sdpa and ks is None
                      and md.fresh_prefill_len >= MIN_FRESH_PREFILL_TOKENS)
        if fresh_sdpa and num_seqs == 1:  # one fresh prompt (a long TTFT): SDPA's own output
            return sdpa_fresh_prefill(q, k, v, None, scale)
        out = torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        if nd > 0:
            kern.paged_decode_attention(q[:nd], kv_cache, md.block_tables[:nd], md.seq_lens[:nd],
                                        scale, out=out[:nd], max_seq_len=md.max_seq_len,
                                        k_scale=ks, v_scale=vs)
        if fresh_sdpa:
            # Prompts with nothing cached attend only to this step's own K/V: vendor SDPA.
            qsl_cpu = md.query_start_loc_cpu
            for i in range(nd, num_seqs):
                a, b = qsl_cpu[i], qsl_cpu[i + 1]
                sdpa_fresh_prefill(q[a:b], k[a:b], v[a:b], out[a:b], scale)
        elif nd < num_seqs:
            # Decodes hold exactly one token each, so prefill tokens start at offset nd.
            qsl = md.query_start_loc[nd:] - nd if nd else md.query_start_loc
            kern.paged_prefill_attention(q[nd:], kv_cache, qsl, md.seq_lens[nd:],
                                         md.block_tables[nd:], scale, md.max_query_len,
                                         out=out[nd:], k_scale=ks, v_scale=vs)
        return out

