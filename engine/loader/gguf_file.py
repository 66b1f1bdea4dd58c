"""Load a GGUF file (llama.cpp format): HF config from metadata, dequantized HF-named tensors."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from engine.config import ModelConfig
from engine.loader.source import ModelSource, check_weight_names
from engine_api.errors import ModelLoadError
from engine_api.gguf_meta import field_value, hf_config_dict, open_gguf, read_metadata

# llama.cpp tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",   # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# Phi-3 / Phi-4 (llama.cpp's "phi3"): the fused projections, stored as Hugging Face has them
# (`gate_up_proj` is gate rows then up rows, as llama.cpp's SwiGLU split reads `ffn_up`).
_FUSED_BLOCK_NAMES = _BLOCK_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 3 (llama.cpp's "gemma3"): a norm after attention and one each side of the MLP.
_GEMMA3_BLOCK_NAMES = _BLOCK_NAMES | {"post_attention_norm": "post_attention_layernorm",
                                      "ffn_norm": "pre_feedforward_layernorm",
                                      "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no HF parameter (llama3 RoPE factors are folded into rope_scaling).
_IGNORED = {"rope_freqs.weight"}


def block_names(config: ModelConfig) -> dict[str, str]:
    """The llama.cpp -> HF layer tensor names of `config`'s architecture: fused QKV and gate/up
    projections (Phi-3), Gemma 3's four norms, or Llama's."""
    if config.fused_checkpoint:
        return _FUSED_BLOCK_NAMES
    return _GEMMA3_BLOCK_NAMES if config.is_gemma else _BLOCK_NAMES


def hf_name(gguf_name: str, names: dict[str, str] = _BLOCK_NAMES) -> str | None:
    """HF parameter name for a llama.cpp tensor name; None if it has no HF counterpart.
    `names`: the architecture's layer tensor names (`block_names`)."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        inner = names.get(m.group(2))
        return f"model.layers.{m.group(1)}.{inner}.{m.group(3)}" if inner else None
    base, _, suffix = gguf_name.rpartition(".")
    top = _TOP_NAMES.get(base)
    return f"{top}.{suffix}" if top else None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head, n_head_kv)` for Q/K rows (weight or bias).

    convert_hf_to_gguf.py reorders each head's rows from HF's half-split RoPE layout
    [x0..x(d/2-1), x(d/2)..x(d-1)] to interleaved pairs: `reshape(n_head, 2, d/2, ...)
    .swapaxes(1, 2)`. Undo it: view rows as (n_head, d/2, 2) and swap back.
    w: [n_head * head_dim, ...]
    """
    head_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, head_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(t: Any) -> np.ndarray:
    """Tensor `t` (a gguf ReaderTensor) as float32 in numpy (= HF) order: [rows, cols].

    GGUF lists dims fastest-first (`t.shape` = [ne0, ne1] = [in, out]), numpy slowest-first.
    """
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def _llama3_rope_scaling(freqs: np.ndarray, head_dim: int, theta: float,
                         path: str) -> dict[str, Any]:
    """Recover HF llama3 `rope_scaling` from llama.cpp's `rope_freqs` tensor (the per-dim divisor).

    The file stores only the resulting factors; we assume Llama 3.x's low/high frequency
    factors (1, 4) and original context (8192) and check they reproduce the tensor exactly.
    """
    factor = float(freqs.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(wavelen < high_wl, 1.0,
                      np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    if expect.shape != freqs.shape or not np.allclose(expect, freqs, rtol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs.weight does not match Llama 3 RoPE scaling; "
                             "this GGUF's RoPE layout is not supported")
    return scaling


def _iter_weights(path: str, config: ModelConfig, permuted: bool) -> Iterator[tuple[str, torch.Tensor]]:
    # Re-opened per stream (the memmap is released when the stream ends), past the metadata.
    reader = open_gguf(path, read_metadata(path))
    names = block_names(config)
    for t in reader.tensors:
        name = hf_name(t.name, names)
        if name is None:
            continue
        w = dequantize(t)
        if config.is_gemma and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its norm multiplies
            # by the weight; Gemma's by 1 + weight): back to the checkpoint's w.
            w = w - np.float32(1.0)
        if permuted and ".q_proj." in name:
            w = unpermute_qk(w, config.num_attention_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_qk(w, config.num_key_value_heads)
        if not w.flags.writeable or not w.flags.c_contiguous:  # F32/F16 tensors view the mmap
            w = np.array(w, order="C")
        yield name, torch.from_numpy(w)


def load_gguf(path: str, weights_id: str) -> ModelSource:
    """ModelSource for GGUF file `path` (validated up front; weights dequantized lazily)."""
    meta = read_metadata(path)
    d = hf_config_dict(meta, path)
    names = meta.tensor_names
    if "rope_freqs.weight" in names and d["rope_scaling"] is None:
        freqs = next(dequantize(t) for t in open_gguf(path).tensors
                     if t.name == "rope_freqs.weight")
        d["rope_scaling"] = _llama3_rope_scaling(freqs, d["head_dim"], d["rope_theta"], path)
    if any(n.startswith("rope_factors_") for n in names):
        raise ModelLoadError(f"{path}: LongRoPE (rope_factors_long / rope_factors_short: Phi-3's "
                             "128k-context models) is not supported")
    config = ModelConfig.from_hf_dict(d, weights_id=weights_id)
    table = block_names(config)
    unknown = sorted(n for n in names if hf_name(n, table) is None and n not in _IGNORED)
    if unknown:
        raise ModelLoadError(f"{path}: unexpected GGUF tensors {unknown[:8]}")
    check_weight_names({h for n in names if (h := hf_name(n, table))}, config, path)
    # llama.cpp permutes Q/K for llama only, not qwen2 / qwen3 / phi3 / gemma3
    permuted = d["model_type"] == "llama"
    generation: dict[str, Any] = {"bos_token_id": d["bos_token_id"],
                                  "eos_token_id": list(config.eos_token_ids)}
    return ModelSource(
        config=config,
        weights=lambda: _iter_weights(path, config, permuted),
        tokenizer_source=path,
        chat_template=field_value(meta, "tokenizer.chat_template"),
        generation_config=generation,
        default_dtype=torch.float32,
    )
