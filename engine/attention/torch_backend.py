"""Reference attention over the paged KV cache in plain torch (CPU and any device).

Writes this step's K/V into the cache, then attends per sequence over the gathered blocks.
Decodes are batched (padded gather + mask); prefills loop over sequences. A quantized (fp8 or
int8) cache is quantized on write and dequantized (times the layer's K/V scale) right after the
gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import PagedAttentionBackend
from engine.attention.forward_context import AttentionMetadata, RopeInputs
from engine.attention.kv_quant import dequantize_kv, is_quantized, quantize_kv


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
                   ) -> None:
    """key/value: [T, Hkv, D] → kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping.

    A quantized (fp8 or int8) cache stores `key / k_scale`, `value / v_scale` (saturated,
    rounded); other caches ignore the scales."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if is_quantized(kv_cache):
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes.
        raw = flat.view(torch.uint8)
        dt = kv_cache.dtype
        raw[0].index_copy_(0, slot_mapping, quantize_kv(key, k_scale, dt).view(torch.uint8))
        raw[1].index_copy_(0, slot_mapping, quantize_kv(value, v_scale, dt).view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
               scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    # -> k, v: [seq_len, Hkv, D] (float32 when the cache is quantized)
    block_size = kv_cache.shape[2]
    n = -(-seq_len // block_size)
    kv = kv_cache[:, block_ids[:n].long()]  # [2, n, bs, Hkv, D]
    kv = kv.reshape(2, n * block_size, *kv_cache.shape[3:])[:, :seq_len]
    if is_quantized(kv_cache):
        return dequantize_kv(kv[0], scales[0]), dequantize_kv(kv[1], scales[1])
    return kv[0], kv[1]


class TorchAttentionBackend(PagedAttentionBackend):
    """Reference backend; a quantized (fp8 or int8) cache is quantized on write and dequantized
    on read with the layer's `kv_scale` (k_scale, v_scale). Does not fuse RoPE: q and k arrive rotated."""

    name = "torch"
    fuses_rope = False
    # Reads lengths and masks back to the host (per-sequence loops): eager only.
    captures_cuda_graphs = False

    def write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: tuple[float, float] = (1.0, 1.0), *,
                 rope: RopeInputs | None = None) -> None:
        """The first half of `forward`: write k, v at `slot_mapping` (-1: not written)."""
        if rope is not None:
            raise ValueError("the torch attention backend does not fuse RoPE (fuses_rope is "
                             "False): rotate q and k before calling it and pass rope=None")
        scales = kv_scale if is_quantized(kv_cache) else (1.0, 1.0)
        write_kv_torch(k, v, kv_cache, slot_mapping, *scales)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata, scale: float,
               kv_scale: tuple[float, float] = (1.0, 1.0), *, sliding_window: int = 0,
               logit_softcap: float = 0.0) -> torch.Tensor:
        """The second half of `forward`: attention over the cache `write_kv` filled."""
        scales = kv_scale if is_quantized(kv_cache) else (1.0, 1.0)
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd > 0:
            out[:nd] = self._decode(q[:nd], kv_cache, md, nd, scale, scales, sliding_window,
                                    logit_softcap)
        qsl, sl = md.query_start_loc_cpu, md.seq_lens_cpu
        for b in range(nd, len(sl)):
            s, e = qsl[b], qsl[b + 1]
            kb, vb = _gather_kv(kv_cache, md.block_tables[b], sl[b], scales)
            out[s:e] = _causal_attention(q[s:e], kb, vb, scale, sliding_window, logit_softcap)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, nd: int,
                scale: float, scales: tuple[float, float], window: int, softcap: float
                ) -> torch.Tensor:
        # q: [B, H, D]; one query per sequence at the last position.
        block_size = kv_cache.shape[2]
        max_len = max(md.seq_lens_cpu[:nd])
        n = -(-max_len // block_size)
        tables = md.block_tables[:nd, :n].long()                   # [B, n]
        kv = kv_cache[:, tables]                                   # [2, B, n, bs, Hkv, D]
        if is_quantized(kv_cache):
            kv = torch.stack((dequantize_kv(kv[0], scales[0]), dequantize_kv(kv[1], scales[1])))
        kv = kv.reshape(2, nd, n * block_size, *kv_cache.shape[3:]).transpose(2, 3)
        k, v = kv[0], kv[1]                                        # [B, Hkv, L, D]
        pos = torch.arange(n * block_size, device=q.device)
        lens = md.seq_lens[:nd, None]
        visible = pos[None, :] < lens                              # [B, L]
        if window > 0:
            visible &= pos[None, :] >= lens - window
        dt = torch.float32 if q.dtype != torch.float32 else q.dtype
        o = _attention(q[:, :, None].to(dt), k.to(dt), v.to(dt), visible[:, None, None, :],
                       scale, softcap)                            # [B, H, 1, D]
        return o[:, :, 0].to(q.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
               scale: float, softcap: float) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked to `visible`) v over heads [..., H, Lq, D] /
    [..., Hkv, Lk, D] (grouped-query heads expanded here); SDPA unless scores are soft-capped,
    which SDPA cannot express."""
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    if softcap <= 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap))
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [Lq, H, D] at the last Lq of Lk positions; k/v: [Lk, Hkv, D] → [Lq, H, D]."""
    lq, lk = q.shape[0], k.shape[0]
    qpos = torch.arange(lk - lq, lk, device=q.device)
    kpos = torch.arange(lk, device=q.device)
    visible = kpos[None, :] <= qpos[:, None]  # [Lq, Lk]
    if window > 0:
        visible &= kpos[None, :] > qpos[:, None] - window
    # Dense [1, H, L, D] operands: on the CPU, SDPA takes its fused (flash) kernel only for
    # those; strided [H, L, D] views fall back to the math path, which materializes and
    # "safe"-softmaxes the whole score matrix (10x slower for a 2k-token chunk of SmolLM2).
    qd, kd, vd = (x.transpose(0, 1).float().unsqueeze(0).contiguous() for x in (q, k, v))
    o = _attention(qd, kd, vd, visible, scale, softcap)
    return o[0].transpose(0, 1).to(q.dtype)
