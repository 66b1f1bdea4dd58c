"""FP8 W8A8 (`--quantization fp8`): the decoder layers' linear layers swapped, after the weights
are loaded, for float8 e4m3fn matmuls (DESIGN.md §5: quantization is applied from outside).

- Weights: per output channel, scale[o] = max|W[o, :]| / 448, stored as e4m3fn (half the bytes
  of bf16). Fused QKV and gate/up keep one scale per row, so their parts stay independent.
- Activations: per token, dynamically at every call (`per_token_quant_fp8`: one Triton launch
  on the GPU, its torch reference elsewhere).
- The matmul is `torch._scaled_mm` with row-wise scales (cuBLASLt fp8 on Hopper/Ada; torch's own
  kernel on the CPU), accumulating in float32 and writing the model dtype; a bias is added after.

The embedding and the LM head stay in the model dtype (as vLLM's fp8 does: they are a small
share of the weights and the logits are the most sensitive output). The fingerprint of a
quantized engine differs from the unquantized one's, so their KV never mixes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ConfigError
from engine.kernels.reference import per_token_quant_fp8_ref

# Decoder-layer projections that are swapped (everything but the embedding and the LM head).
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (e4m3fn `[N, K]`, float32 per-row scale `[N]`) with W ≈ q * scale[:, None]:
    a weight's output channels are quantized exactly as activation rows are."""
    q, scale = per_token_quant_fp8_ref(weight)
    return q, scale[:, 0]


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W and each row of x in e4m3fn under float32 scales."""

    def __init__(self, linear: nn.Linear, use_triton: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % 16 or self.out_features % 16:
            raise ConfigError(f"fp8 matmuls need in/out features divisible by 16, got "
                              f"{self.in_features}/{self.out_features}")
        q, scale = quantize_weight_fp8(linear.weight.detach())
        # `_scaled_mm` takes the weight as a column-major [K, N]: the transpose of row-major q.
        self.register_buffer("weight_t", q.t(), persistent=False)
        self.register_buffer("weight_scale", scale[None, :].contiguous(), persistent=False)
        self.weight_t: torch.Tensor
        self.weight_scale: torch.Tensor
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))
        self.use_triton = use_triton
        if use_triton:  # resolved once: the forward pass is a decode step's hot path
            from engine.kernels import per_token_quant_fp8
            self._quantize = per_token_quant_fp8
        else:
            self._quantize = per_token_quant_fp8_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, x_scale = self._quantize(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(xq, self.weight_t, scale_a=x_scale, scale_b=self.weight_scale,
                             out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


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
    swaps: list[tuple[nn.Module, str, nn.Linear]] = []
    for module in model.modules():
        for name in QUANTIZED_LINEARS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                swaps.append((module, name, child))
    for parent, name, linear in swaps:
        setattr(parent, name, Fp8Linear(linear, use_triton))
    for module in model.modules():  # the batch-1 GEMV reads bf16 weights: not after the swap
        if hasattr(module, "use_gemv"):
            setattr(module, "use_gemv", False)  # noqa: B010 - any module with the flag
    return len(swaps)
