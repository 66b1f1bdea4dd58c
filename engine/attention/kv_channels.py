"""Per-channel factors of an int8 KV cache, applied around attention.

An int8 cache has one scale per layer for K and one for V (engine/attention/kv_calibration.py):
`round(x / scale)` with `scale = amax / 127`. Where a few channels of K or V are much larger than
the rest (Gemma 3 270M: K's largest channel is 10-30x the median one's), every other channel
gets only a few of the 255 levels. So each channel also has a factor `f`, and the cache stores
`round(x / (scale * f))`: a channel that never exceeds a tenth of the layer's largest value
gets a ten times finer step.

The factors come from the calibration pass's largest |K| and |V| per channel:
`f = headroom * amax_channel / amax_layer`, `K_HEADROOM` for K and `V_HEADROOM` for V (a channel
quiet on the calibration text may be louder on served text: past `headroom` times its
calibration maximum it saturates, as a layer's values past its scale do), never below
`MIN_FACTOR` (a channel all but silent in calibration keeps a step no finer than 1/`MIN_FACTOR`
of the layer's), rounded up to 4 significant bits as the layer scales are (`round_scales`), so
that two workers' calibrations almost always agree exactly. On Gemma 3 270M's int8 cache
(tools/probes/probe_quant_ppl.py, KL from the unquantized model; bench/results/
cpu_quant_accuracy.json, "int8_kv_headroom"): headroom 1.0 / 1.0 gives KL 0.053, 1.25 / 1.5
0.014, 2.0 / 2.0 0.025 (one scale per layer: 0.129): too little headroom saturates channels
the text drives past the calibration's maxima, too much coarsens every step. K's and V's
headroom were not swept apart.

K is cached after RoPE, which rotates each pair of channels (i, i + D/2) (the engine's RoPE is
NeoX-style, `RotaryEmbedding`): a pair's two channels share one factor, the larger of their two,
so dividing k by the factors commutes with the rotation and may be done before it (the Triton
backend rotates inside its KV-write kernel). V's channels each have their own.

Where the factors are applied: around attention, not in the weights and not in the kernels.
The attention layer (engine/model/decoder.py) multiplies q by K's factors and divides k by them
(q.k is unchanged), divides v by V's factors, writes k, v to the cache with the layer's scales as
before, and multiplies attention's output by V's factors (softmax(q k^T) v is linear in v per
channel). So every attention kernel keeps one scale per layer, and the factors are plain torch
multiplies on static device tensors: CUDA graphs and piecewise graphs capture them like any other
op, with no host reads. Folding them into the QKV and O weights at load would save the
multiplies, but would have to be redone for LoRA deltas on q, k, v and o, for weights quantized
at load (FP8 W8A8 is quantized before calibration runs), for Qwen3/Gemma 3's q/k norms (whose
weight is shared by every head) and for each tensor-parallel shard; the runtime multiplies
handle all of them unchanged.

Only int8 caches take factors: fp8 (e4m3) keeps ~2 significant digits over its whole range, so
a small channel loses little beside a large one, and fp8 keeps one scale per layer.

Nor does calibration give factors to an int8 cache whose decode attention runs the QK dot on
int8 (`qk_dot_on_int8`: the Triton decode kernel on a GPU, head_dim <= 128, unless
`SPLITSERVE_INT8_QK=0`). That kernel rounds each row of q to int8 with one scale, and q times K's
factors has the outlier channels K had: the precision the factors give K, q's rounding takes
back. Emulated on the CPU (tools/probes/probe_kv_qk_int8.py; relative error of the scores, mean
over layers, bench/results/cpu_quant_accuracy.json): under the int8 QK dot SmolLM2 goes from
0.020 per layer to 0.029 with factors, Gemma 3 270M from 0.028 to 0.020 (its head_dim of 256
takes the fp16 QK path on the GPU anyway); over an fp16 or float32 QK dot the factors cut it,
SmolLM2 0.017 to 0.014, Gemma 3 0.024 to 0.0074.
A scales file's factors apply wherever it is given (workers that share a file agree).

Shapes: the whole model's factors are `[num_layers, 2, num_kv_heads, head_dim]` float32 on the
CPU (K, V); each tensor-parallel rank applies its own KV heads' share.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from typing import Protocol

import torch

from engine.attention.kv_calibration import round_scales

K_HEADROOM = 1.25
V_HEADROOM = 1.5
MIN_FACTOR = 2.0 ** -6


def qk_dot_on_int8(device: torch.device, backend: str, head_dim: int) -> bool:
    """Whether an int8 cache's decode attention rounds q to int8 for its QK dot (see above):
    the Triton backend on a GPU, as `choose_decode_tiles` picks its tiles."""
    if device.type != "cuda" or backend != "triton":
        return False
    from engine.kernels.decode_attention import choose_decode_tiles

    return choose_decode_tiles(head_dim, torch.int8).qk_int8


def pair_max(amax: torch.Tensor) -> torch.Tensor:
    """`[..., D]` → each channel replaced by the larger of it and its RoPE partner
    (i and i + D/2): equal across every rotated pair."""
    half = amax.shape[-1] // 2
    m = torch.maximum(amax[..., :half], amax[..., half:])
    return torch.cat((m, m), dim=-1)


def channel_factors(amax: torch.Tensor, k_headroom: float = K_HEADROOM,
                    v_headroom: float = V_HEADROOM, min_factor: float = MIN_FACTOR
                    ) -> torch.Tensor:
    """Per-channel largest |K|, |V| `[L, 2, Hkv, D]` → factors of the same shape: relative to
    each layer's largest value (the layer scale's amax), with headroom, floored, rounded up to
    4 significant bits; K's equal across RoPE pairs. A layer that saw only zeros gets 1.0."""
    if amax.dim() != 4 or amax.shape[1] != 2 or amax.shape[-1] % 2:
        raise ValueError(f"per-channel maxima must be [L, 2, Hkv, D] with D even, got "
                         f"{tuple(amax.shape)}")
    amax = amax.detach().float().cpu()
    channel = torch.stack((pair_max(amax[:, 0]), amax[:, 1]), dim=1)
    layer = amax.amax(dim=(2, 3), keepdim=True)
    # The ratio first, then the headroom: the layer's largest channel is then exactly the
    # headroom (x * 1.5 / x can round to just above 1.5, which rounds up a whole step, 1.625,
    # by float noise that differs between one process and a tensor-parallel group).
    headroom = torch.tensor([k_headroom, v_headroom]).view(1, 2, 1, 1)
    rel = torch.where(layer > 0, channel / layer.clamp_min(1e-30) * headroom,
                      torch.ones_like(channel))
    return round_scales(rel.clamp_min(min_factor))


def layer_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-channel maxima `[L, 2, Hkv, D]` → each layer's `[L, 2]` (what the layer scales are of)."""
    return amax.amax(dim=(2, 3))


def factors_digest(factors: torch.Tensor | None) -> str | None:
    """A hex SHA-256 of the factors' float32 bytes (None without): what the model fingerprint
    holds, so that blocks stored under other factors never meet these."""
    if factors is None:
        return None
    data = factors.detach().float().cpu().reshape(-1)
    packed = struct.pack(f"<{data.numel()}f", *data.tolist())
    return hashlib.sha256(repr(tuple(factors.shape)).encode() + packed).hexdigest()


class LayerChannelFactors:
    """One layer's factors on its device, as the attention layer applies them (this rank's KV
    heads; `num_heads` query heads, grouped over them)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        """k, v: `[Hkv, D]` factors of this rank's KV heads."""
        group = num_heads // k.shape[0]

        def on(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, dtype=dtype).contiguous()

        # Static tensors for the engine's life: graphs capture their addresses.
        self.q_mul = on(k.float().repeat_interleave(group, dim=0))  # [H, D]: q * f_k
        self.k_mul = on(1.0 / k.float())                             # [Hkv, D]: k / f_k
        self.v_mul = on(1.0 / v.float())                             # [Hkv, D]: v / f_v
        self.o_mul = on(v.float().repeat_interleave(group, dim=0))  # [H, D]: out * f_v

    def scale_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k, v [T, Hkv, D] → q * f_k, k / f_k, v / f_v, in place (views of the
        fused QKV output stay views of it: piecewise graphs read them from their buffer)."""
        return q.mul_(self.q_mul), k.mul_(self.k_mul), v.mul_(self.v_mul)

    def scale_output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention's output [T, H, D] over the scaled v → times f_v (a new tensor)."""
        return o * self.o_mul


def rank_share(factors: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The whole model's `[L, 2, Hkv, D]` → tensor-parallel rank `rank`'s KV heads (ranks hold
    consecutive equal shares of the heads, `shard_model_config`)."""
    return factors.chunk(size, dim=2)[rank]


class FactoredAttention(Protocol):
    """What `install` sets on an attention layer (`LlamaAttention` is one)."""

    num_heads: int
    kv_channels: LayerChannelFactors | None


def install(attentions: Iterable[FactoredAttention], factors: torch.Tensor | None, rank: int,
            size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Give each attention layer (of tensor-parallel rank `rank` of `size`; activations of
    `dtype` on `device`) its share of the whole model's `[L, 2, Hkv, D]` channel factors
    (None: none)."""
    share = None if factors is None else rank_share(factors, rank, size)
    for i, attn in enumerate(attentions):
        attn.kv_channels = None if share is None else LayerChannelFactors(
            share[i, 0], share[i, 1], attn.num_heads, device, dtype)
