"""Weight quantization, applied after the weights are loaded by swapping the decoder layers'
linear layers (docs/architecture.md, "Engine internals": quantization is applied from outside the model).

`--quantization int8` (W8A16, weight-only): `Int8Linear` keeps each weight as int8 with a
float32 scale per output channel (scale[o] = max|W[o, :]| / 127, round to nearest); activations
stay in the model dtype. Half the weight bytes of bf16, so batch-1 decode, a pure weight stream,
can approach half the time. The Triton path widens the int8 tile in registers: the batch-1 GEMV
(with the RMSNorm fused in, as for bf16) for one row, `w8a16_matmul` otherwise; the torch path
multiplies in float32 by the int8 values and scales the result.

`--quantization fp8` (W8A8) swaps them for float8 e4m3fn matmuls:

- Weights: per output channel, scale[o] = max|W[o, :]| / 448, stored as e4m3fn (half the bytes
  of bf16). Fused QKV and gate/up keep one scale per row, so their parts stay independent.
- Activations: per token, dynamically at every call (`per_token_quant_fp8`: one Triton launch
  on the GPU, its torch reference elsewhere).
- The matmul is `torch._scaled_mm` with row-wise scales (cuBLASLt fp8 on Hopper/Ada; torch's own
  kernel on the CPU), accumulating in float32 and writing the model dtype; a bias is added after.
  One-row inputs (batch-1 decode) on the Triton path take the GEMV kernel instead (same
  arithmetic, engine/kernels/gemv.py; `SPLITSERVE_GEMV=0` keeps cuBLASLt). The RMSNorms are not
  folded into it as for bf16: the normalised row must be quantized before the matmul.

The embedding and the LM head stay in the model dtype (as vLLM's fp8 does: they are a small
share of the weights and the logits are the most sensitive output). The fingerprint of a
quantized engine differs from the unquantized one's, so their KV never mixes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ConfigError
from engine.kernels.reference import per_token_quant_fp8_ref
from engine.model.layers import gemv_enabled

# Decoder-layer projections that are swapped (everything but the embedding and the LM head).
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (e4m3fn `[N, K]`, float32 per-row scale `[N]`) with W ≈ q * scale[:, None]:
    a weight's output channels are quantized exactly as activation rows are."""
    q, scale = per_token_quant_fp8_ref(weight)
    return q, scale[:, 0]


class _QuantizedLinear(nn.Module):
    """What every quantized replacement of an `nn.Linear` keeps of it: the shape, the bias
    (in the model dtype, added after the matmul) and which path it runs."""

    def __init__(self, linear: nn.Linear, use_triton: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))
        self.use_triton = use_triton


class Fp8Linear(_QuantizedLinear):
    """y = x W^T (+ b) with W and each row of x in e4m3fn under float32 scales."""

    def __init__(self, linear: nn.Linear, use_triton: bool) -> None:
        super().__init__(linear, use_triton)
        if self.in_features % 16 or self.out_features % 16:
            raise ConfigError(f"fp8 matmuls need in/out features divisible by 16, got "
                              f"{self.in_features}/{self.out_features}")
        q, scale = quantize_weight_fp8(linear.weight.detach())
        # `_scaled_mm` takes the weight as a column-major [K, N]: the transpose of row-major q.
        self.register_buffer("weight_t", q.t(), persistent=False)
        self.register_buffer("weight_scale", scale[None, :].contiguous(), persistent=False)
        self.weight_t: torch.Tensor
        self.weight_scale: torch.Tensor
        self._gemv = None
        if use_triton:  # resolved once: the forward pass is a decode step's hot path
            from engine.kernels import per_token_quant_fp8
            self._quantize = per_token_quant_fp8
            if gemv_enabled():
                from engine.kernels.gemv import gemv
                self._gemv = gemv
        else:
            self._quantize = per_token_quant_fp8_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        xq, x_scale = self._quantize(x2)
        if self._gemv is not None and x2.shape[0] == 1:
            # One row (batch-1 decode): the Triton GEMV streams the e4m3 weight (row-major, the
            # transpose of `weight_t`) at the memory's rate, where cuBLASLt's fp8 kernels are
            # built for many rows. Same W8A8 arithmetic (exact e4m3 products, float32 sums).
            y = self._gemv(xq, self.weight_t.t(), self.bias, weight_scale=self.weight_scale[0],
                           x_scale=x_scale, out_dtype=x.dtype)
        else:
            y = torch._scaled_mm(xq, self.weight_t, scale_a=x_scale, scale_b=self.weight_scale,
                                 out_dtype=x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (int8 `[N, K]`, float32 per-row scale `[N]`) with W ≈ q * scale[:, None],
    symmetric, round to nearest; an all-zero row gets scale 1 (its q is all zero)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(_QuantizedLinear):
    """y = x (q * scale)^T (+ b): int8 weights, a float32 scale per output channel (W8A16)."""

    def __init__(self, linear: nn.Linear, use_triton: bool) -> None:
        super().__init__(linear, use_triton)
        q, scale = quantize_weight_int8(linear.weight.detach())
        self.register_buffer("weight", q, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.weight: torch.Tensor
        self.weight_scale: torch.Tensor
        if use_triton:  # resolved once: the forward pass is a decode step's hot path
            from engine.kernels.gemv import gemv
            from engine.kernels.w8a16 import w8a16_linear
            self._gemv, self._matmul = gemv, w8a16_linear

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, bias, weight_scale) for the batch-1 GEMV kernels."""
        return self.weight, self.bias, self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.use_triton:
            if x2.shape[0] == 1:
                y = self._gemv(x2, self.weight, self.bias, weight_scale=self.weight_scale)
            else:
                y = self._matmul(x2, self.weight, self.weight_scale, self.bias)
        else:
            y = (nn.functional.linear(x2.float(), self.weight.float())
                 * self.weight_scale).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


@torch.no_grad()
def apply_int8_weight_only(model: nn.Module, use_triton: bool) -> int:
    """Swap the decoder layers' projections for `Int8Linear` in place; returns how many. The
    batch-1 GEMV path stays on: it reads int8 weights with their scales."""
    swaps = _linears_to_swap(model)
    for parent, name, linear in swaps:
        setattr(parent, name, Int8Linear(linear, use_triton))
    experts = [m for m in model.modules() if hasattr(m, "quantize_int8")]
    for m in experts:  # a mixture of experts' stacked weights (engine/model/moe.py)
        getattr(m, "quantize_int8")()  # noqa: B009 - duck-typed: moe.py imports this module
    return len(swaps) + 2 * len(experts)


def _linears_to_swap(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    swaps: list[tuple[nn.Module, str, nn.Linear]] = []
    for module in model.modules():
        for name in QUANTIZED_LINEARS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                swaps.append((module, name, child))
    return swaps


def check_fp8_supported(device: torch.device, dtype: torch.dtype) -> None:
    """FP8 matmuls need an sm_89+ GPU (Ada/Hopper) and a bf16 model there (cuBLASLt's row-wise
    scaled fp8 matmuls write bf16), or the CPU (torch's own kernel, any float dtype)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"quantization 'fp8' needs an sm_89+ GPU (Ada, Hopper); this one "
                              f"is sm_{major}{minor}")
        if dtype != torch.bfloat16:
            raise ConfigError(f"quantization 'fp8' on the GPU needs dtype bfloat16, got {dtype}")


@torch.no_grad()
def apply_fp8_w8a8(model: nn.Module, use_triton: bool) -> int:
    """Swap the decoder layers' projections for `Fp8Linear` in place; returns how many."""
    swaps = _linears_to_swap(model)
    for parent, name, linear in swaps:
        setattr(parent, name, Fp8Linear(linear, use_triton))
    # The decoder layers' norm-fused batch-1 GEMVs take float or int8 weights, not W8A8 (whose
    # row is quantized after the norm): `Fp8Linear` runs its own one-row GEMV instead.
    for module in model.modules():
        if hasattr(module, "use_gemv"):
            setattr(module, "use_gemv", False)  # noqa: B010 - any module with the flag
    return len(swaps)
