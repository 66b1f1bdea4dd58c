"""Pure-torch references for every Triton kernel in this package (the oracles).

These are written for clarity, not speed: the attention references loop over sequences on the
host (reading `seq_lens` with `.tolist()`), so they are not CUDA-graph capturable. All math is
done in float32 and cast back to the input dtype, as the kernels do. They run on any device.

Quantized caches: `write_kv_ref` stores `clamp(x * (1 / scale), -448, 448)` rounded to fp8
(e4m3), or `clamp(x * (1 / scale), -127, 127)` rounded to the nearest integer (halves away from
zero) for int8, and the attention references read `stored * scale`, with one K and one V scale
(floats or one-element tensors, read on the host here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
INT8_KV_MAX = 127.0
QUANT_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)


def _scale_value(scale: float | torch.Tensor | None) -> float:
    return 1.0 if scale is None else float(scale)


def quantize_fp8_ref(x: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
    """`x / scale`, saturated to +-448, rounded to float8_e4m3fn (computed in float32)."""
    y = x.float() * (1.0 / _scale_value(scale))
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_int8_ref(x: torch.Tensor, scale: float | torch.Tensor | None) -> torch.Tensor:
    """`x / scale`, saturated to +-127, rounded to the nearest integer with halves away from
    zero (computed in float32), as int8."""
    y = (x.float() * (1.0 / _scale_value(scale))).clamp(-INT8_KV_MAX, INT8_KV_MAX)
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).to(torch.int8)


def quantize_ref(x: torch.Tensor, scale: float | torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """`x` quantized for a cache of `dtype` (fp8 e4m3 or int8)."""
    if dtype == torch.int8:
        return quantize_int8_ref(x, scale)
    return quantize_fp8_ref(x, scale)


def dequantize_kv_ref(kv_cache: torch.Tensor, k_scale: float | torch.Tensor | None,
                      v_scale: float | torch.Tensor | None) -> torch.Tensor:
    """A cache `[2, NB, BS, Hkv, D]` in float32 with quantized (fp8 or int8) values multiplied
    by their scales (other dtypes are only upcast)."""
    out = kv_cache.float()
    if kv_cache.dtype in QUANT_KV_DTYPES:
        out[0] *= _scale_value(k_scale)
        out[1] *= _scale_value(v_scale)
    return out


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Scatter `key`/`value` `[T, Hkv, D]` into `kv_cache` `[2, NB, BS, Hkv, D]` in place.

    Slot `s` is block `s // BS`, offset `s % BS`; slots < 0 are skipped. A quantized (fp8 or
    int8) cache stores the values quantized with k_scale / v_scale.
    """
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [NB * BS, Hkv, D]
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if kv_cache.dtype in QUANT_KV_DTYPES:
        flat_k[slots] = quantize_ref(key[valid], k_scale, kv_cache.dtype)
        flat_v[slots] = quantize_ref(value[valid], v_scale, kv_cache.dtype)
    else:
        flat_k[slots] = key[valid].to(kv_cache.dtype)
        flat_v[slots] = value[valid].to(kv_cache.dtype)


def gather_kv_ref(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather one sequence's K and V `[seq_len, Hkv, D]` from its blocks."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Causal varlen attention over a paged cache; returns `[T, H, D]` in q's dtype.

    Query token `i` of sequence `b` sits at KV position `seq_len_b - q_len_b + i` and attends to
    KV positions `<=` it (and, with `sliding_window` W > 0, `> ` it minus W). A sequence with
    `seq_len == 0` yields zeros. A quantized (fp8 or int8) cache is dequantized with
    k_scale / v_scale first. `logit_softcap` c > 0: scaled scores s become c * tanh(s / c).
    """
    if kv_cache.dtype in QUANT_KV_DTYPES:
        kv_cache = dequantize_kv_ref(kv_cache, k_scale, v_scale)
    group = q.shape[1] // kv_cache.shape[3]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0 or seq_len == 0:
            continue
        k, v = gather_kv_ref(kv_cache, block_tables[b], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        qb = q[q_begin:q_end].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qb, k) * scale  # [H, L, S]
        if logit_softcap > 0.0:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        kv_pos = torch.arange(seq_len, device=q.device)
        visible = kv_pos[None, :] <= q_pos[:, None]  # [L, S]
        if sliding_window > 0:
            visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Decode attention: one query token per sequence (`q: [B, H, D]`) at position seq_len-1."""
    batch = q.shape[0]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                               k_scale, v_scale, sliding_window, logit_softcap)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, Hugging Face Llama semantics, with optional fused add.

    With `residual`: `s = x + residual` (in float32, stored in x's dtype as the new residual),
    returns `(norm(s), s)`. The normalised value is rounded to x's dtype before the weight
    multiply, as `LlamaRMSNorm` does.
    """
    if residual is not None:
        summed = x.float() + residual.float()
        new_residual = summed.to(x.dtype)
        return _rms(summed, weight, eps, x.dtype), new_residual
    return _rms(x.float(), weight, eps, x.dtype)


def _rms(x32: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = (x32 * torch.rsqrt(variance + eps)).to(dtype)
    return (normed.float() * weight.float()).to(dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Apply RoPE in place to `q [T, H, D]` and `k [T, Hkv, D]`.

    `cos_sin_cache [max_pos, D]` holds cos in its first D/2 columns and sin in the rest.
    Neox style rotates halves (x[:D/2], x[D/2:]); GPT-J style rotates (x[2i], x[2i+1]).
    """
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, D]
    cos = cos_sin[:, None, :half]  # [T, 1, D/2]
    sin = cos_sin[:, None, half:]
    for t in (q, k):
        x = t.float()
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:]
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox:
            rotated = torch.cat([o1, o2], dim=-1)
        else:
            rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
        t.copy_(rotated.to(t.dtype))


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :I]) * x[:, I:]` computed in float32, returned in x's dtype `[T, I]`."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].float(), x[..., inter:].float()
    return (F.silu(gate) * up).to(x.dtype)


def score_rows_ref(logits: torch.Tensor, targets: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logprob, 1-based rank by logit, log-sum-exp, argmax) per row, in float32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    t_logit = x.gather(1, targets[:, None]).squeeze(1)
    rank = (x > t_logit[:, None]).sum(-1) + 1
    return t_logit - lse, rank, lse, x.argmax(dim=-1)


# Floor of a per-row fp8 scale: only an all-zero row reaches it (its values stay 0), so every
# other row, however small, spans the whole e4m3 range.
FP8_MIN_SCALE = torch.finfo(torch.float32).tiny


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic float8 e4m3fn quantization: (q [T, K], scale [T, 1] float32), x ≈ q *
    scale; scale = max|row| / 448, floored at FP8_MIN_SCALE (an all-zero row)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    q = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`gelu(x[:, :I], approximate="tanh") * x[:, I:]` computed in float32, returned in x's
    dtype `[T, I]` (transformers' `gelu_pytorch_tanh`, Gemma's MLP)."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].float(), x[..., inter:].float()
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)
