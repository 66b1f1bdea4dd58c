"""Triton kernels of the GPU fast path, each with a pure-torch reference in `reference.py`.

Importing this package never imports Triton: the kernel wrappers load on first attribute access
(`engine.kernels.paged_decode_attention`), so CPU-only installs without Triton still import it.
Check `triton_available()` before calling a kernel.

    write_kv(key, value, kv_cache, slot_mapping)                     -> None (writes kv_cache)
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=None,
                           num_splits=None, max_seq_len=None)        -> out [B, H, D]
    paged_prefill_attention(q, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                            max_query_len, out=None)                 -> out [T, H, D]
    rms_norm(x, weight, eps, residual=None)          -> normed | (normed, new_residual)
    rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True)   -> None (in place)
    rotary_and_write_kv(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping,
                        k_scale=None, v_scale=None, is_neox=True)   -> None (rotary, then write_kv)
    silu_and_mul(x), gelu_tanh_and_mul(x)                            -> [T, I]
    per_token_quant_fp8(x)                       -> (q [T, K] float8 e4m3fn, scale [T, 1] fp32)
    score_rows(logits, targets)        -> (target logprob, rank, log-sum-exp, argmax), [R] each
    moe_gemm(a, weights, layout, top_k, gather_tokens, routing_weights=None)
                                   -> [pairs, N] (each pair's rows times its expert's weight)
    lora_expand(h, b_all, col_slot, token_slots, y)  -> y += each row's adapter's h @ B (in place)
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from engine.kernels._checks import KernelInputError

if TYPE_CHECKING:
    from engine.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from engine.kernels.decode_attention import choose_num_splits, paged_decode_attention
    from engine.kernels.fused_moe import moe_gemm
    from engine.kernels.kv_write import write_kv
    from engine.kernels.lora import lora_expand
    from engine.kernels.norm import rms_norm
    from engine.kernels.prefill_attention import paged_prefill_attention
    from engine.kernels.quant_fp8 import per_token_quant_fp8
    from engine.kernels.rope_kv_write import rotary_and_write_kv
    from engine.kernels.rotary import rotary_embedding
    from engine.kernels.score import score_rows

# public name -> module that defines it (module names differ from function names so importing a
# submodule never shadows the function attribute of this package)
_LAZY: dict[str, str] = {
    "write_kv": "engine.kernels.kv_write",
    "paged_decode_attention": "engine.kernels.decode_attention",
    "choose_num_splits": "engine.kernels.decode_attention",
    "paged_prefill_attention": "engine.kernels.prefill_attention",
    "rms_norm": "engine.kernels.norm",
    "rotary_embedding": "engine.kernels.rotary",
    "rotary_and_write_kv": "engine.kernels.rope_kv_write",
    "silu_and_mul": "engine.kernels.activation",
    "gelu_tanh_and_mul": "engine.kernels.activation",
    "per_token_quant_fp8": "engine.kernels.quant_fp8",
    "score_rows": "engine.kernels.score",
    "moe_gemm": "engine.kernels.fused_moe",
    "lora_expand": "engine.kernels.lora",
}

__all__ = [
    "KernelInputError",
    "choose_num_splits",
    "gelu_tanh_and_mul",
    "lora_expand",
    "moe_gemm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "per_token_quant_fp8",
    "rms_norm",
    "rotary_and_write_kv",
    "rotary_embedding",
    "score_rows",
    "silu_and_mul",
    "triton_available",
    "write_kv",
]


def triton_available() -> bool:
    """True when Triton imports and can run: on a CUDA GPU, or in its interpreter.

    The interpreter counts only when `TRITON_INTERPRET=1` was set before Triton was imported.
    """
    try:
        import triton  # noqa: F401  (importable, not just present: a broken install counts as missing)
    except ImportError:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    import torch

    return bool(torch.cuda.is_available())


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value
