"""Hugging Face `transformers` baseline on the engine's benchmark shapes (random weights).

The model is built from a config (no download) directly on the target device, then
`generate` runs greedy at batch B with input length I and exactly O new tokens
(min_new_tokens = max_new_tokens = O). Reported: output tok/s, time per generated token of
the whole call, and — measured by a separate 1-token call — the prefill time and the decode
step time (generate time minus prefill, over O - 1 steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bench.models import preset_config

# Keys of our presets that are not LlamaConfig arguments (or are set separately).
_DROP_KEYS = ("torch_dtype", "dtype", "eos_token_id")


@dataclass(frozen=True, slots=True)
class HfResult:
    """One `generate` measurement."""

    batch_size: int
    input_len: int
    output_len: int
    duration_s: float            # the measured generate call
    output_tok_s: float          # B * O / duration
    ms_per_token: float          # duration / O (one "step" including the prefill share)
    prefill_ms: float | None     # a generate call with one new token
    decode_step_ms: float | None  # (duration - prefill) / (O - 1)
    device: str
    dtype: str


def build_model(model: str, device: str, dtype_name: str = "bfloat16",
                overrides: dict[str, Any] | None = None) -> Any:
    """A random-weight `AutoModelForCausalLM` of preset `model`, built on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg_dict = {k: v for k, v in preset_config(model).items() if k not in _DROP_KEYS}
    cfg_dict.update(overrides or {})
    config = LlamaConfig(**cfg_dict)
    dtype = getattr(torch, dtype_name)
    # Built under the device context so an 8B model is initialised on the GPU, not in host RAM.
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                              **{_dtype_kwarg(): dtype})
    return hf.to(dtype).eval()


def _dtype_kwarg() -> str:
    """`dtype` since transformers 4.56 (`torch_dtype` is deprecated there), else `torch_dtype`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _generate(hf: Any, input_ids: Any, new_tokens: int) -> float:
    import torch

    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=0, eos_token_id=None)
    sync()
    elapsed = time.perf_counter() - start
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - input_ids.shape[1]} tokens, "
                           f"expected {new_tokens}")
    return elapsed


def run_generate(hf: Any, batch_size: int, input_len: int, output_len: int, seed: int = 0,
                 warmup: bool = True, measure_prefill: bool = True) -> HfResult:
    """Time `generate` at batch B (input I, output O) on random token ids."""
    import torch

    device = next(hf.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(0, hf.config.vocab_size, (batch_size, input_len),
                              generator=gen).to(device)
    if warmup:
        _generate(hf, input_ids, min(output_len, 2))
    prefill_s = _generate(hf, input_ids, 1) if measure_prefill else None
    duration = _generate(hf, input_ids, output_len)
    decode_ms = ((duration - prefill_s) / (output_len - 1) * 1000.0
                 if prefill_s is not None and output_len > 1 else None)
    return HfResult(
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        duration_s=duration,
        output_tok_s=batch_size * output_len / duration,
        ms_per_token=duration / output_len * 1000.0,
        prefill_ms=prefill_s * 1000.0 if prefill_s is not None else None,
        decode_step_ms=decode_ms,
        device=str(device),
        dtype=str(next(hf.parameters()).dtype).removeprefix("torch."),
    )
