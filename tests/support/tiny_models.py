"""Tiny random Hugging Face models for the engine tests: Llama with plain RoPE, Llama with
llama3 RoPE scaling and tied embeddings, Qwen2 with QKV bias, Qwen3 with q/k norms and a
head_dim that is not hidden / heads, Phi-3 with fused checkpoint weights, three mixtures of
experts: Qwen3-MoE, Qwen2-MoE and Mixtral, and sliding windows shorter than the tests' prompts:
Mistral's on every layer, Gemma 2's and Gemma 3's on some; Gemma 3's language model also inside
a Gemma3ForConditionalGeneration with a vision tower.

The tiny models are written with transformers' `save_pretrained(safe_serialization=True)`, so
the engine's loader reads exactly what `transformers` reads back as the reference. The session
fixtures over them (`tiny_model_dirs`, `hf_reference`) are in tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SiglipVisionConfig,
)

# Small enough for 2 shared CPU cores; 4 heads over 2 KV heads exercises GQA.
TINY_ARCH: dict[str, Any] = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

TINY_MODELS = ("llama", "llama3", "qwen2", "qwen3", "phi3", "qwen3moe", "qwen2moe", "mixtral",
               "mistral_swa", "gemma2", "gemma3", "gemma3mm")
# The mixtures of experts: 8 experts, 2 per token (Qwen3-MoE renormalising, with a dense MLP in
# its last layer; Qwen2-MoE the same plus a gated shared expert and QKV bias); Mixtral's 4
# experts, 2 per token.
MOE_ARCH: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


# Gemma's windowed layers: windows of 5 (Gemma 2, and Mistral's) and 6 positions (Gemma 3),
# which the 13-token prompt outgrows; Gemma 2 with attention scores capped at 5 and logits at
# 2.5, its embeddings untied (tied, the sqrt(hidden)-scaled input embedding makes the random
# model repeat its last token; Gemma 3 ties them); Gemma 3 with local and global RoPE tables
# apart (the global one linearly scaled). Layer 0 slides, layer 1 attends to all.
GEMMA_ARCH: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention"])
# Gemma 3 4B/12B/27B's checkpoints: the language model beside a SigLIP vision tower (here one
# layer over 2 x 2 patches) and its projector, which the engine does not load.
TINY_SIGLIP: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)


def _gemma3_text_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(**TINY_ARCH, **GEMMA_ARCH, sliding_window=6, rope_theta=1e4,
                            rope_local_base_freq=100.0,
                            rope_scaling={"rope_type": "linear", "factor": 2.0})


def _randomize(model: PreTrainedModel, seed: int) -> None:
    """Spread every parameter (norm weights and biases too, which HF initialises to 1 and 0) so
    a wrong bias / norm / projection load cannot hide, and greedy outputs are not degenerate.
    Gemma's norms scale by 1 + w (w initialised to 0), so theirs by about 2 here."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def _build(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    # RoPE options as a dict: transformers 5 maps these legacy keys onto `rope_parameters`.
    rope: dict[str, Any] = {"rope_theta": 10000.0}
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY_ARCH, **rope, tie_word_embeddings=False))
    if name == "llama3":
        rope["rope_scaling"] = dict(LLAMA3_ROPE)
        return LlamaForCausalLM(LlamaConfig(**TINY_ARCH, **rope, tie_word_embeddings=True))
    if name == "qwen2":
        rope["rope_theta"] = 1e6
        return Qwen2ForCausalLM(Qwen2Config(**TINY_ARCH, **rope, tie_word_embeddings=False))
    if name == "qwen3":
        rope["rope_theta"] = 1e6  # head_dim 32: 4 heads x 32 = 128 query features, hidden 64
        return Qwen3ForCausalLM(Qwen3Config(**TINY_ARCH, **rope, head_dim=32,
                                            tie_word_embeddings=True))
    if name == "phi3":
        return Phi3ForCausalLM(Phi3Config(**TINY_ARCH, **rope, tie_word_embeddings=False))
    if name == "qwen3moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_ARCH, **rope, **MOE_ARCH, head_dim=16,
                                                  tie_word_embeddings=False))
    if name == "qwen2moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**TINY_ARCH, **rope, **MOE_ARCH,
                                                  shared_expert_intermediate_size=48,
                                                  tie_word_embeddings=False))
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**TINY_ARCH, **rope, num_local_experts=4,
                                                num_experts_per_tok=2, sliding_window=None,
                                                tie_word_embeddings=False))
    if name == "mistral_swa":
        return MistralForCausalLM(MistralConfig(**TINY_ARCH, **rope, sliding_window=5,
                                                tie_word_embeddings=False))
    if name == "gemma2":
        return Gemma2ForCausalLM(Gemma2Config(**TINY_ARCH, **rope, **GEMMA_ARCH, sliding_window=5,
                                              attn_logit_softcapping=5.0,
                                              final_logit_softcapping=2.5,
                                              tie_word_embeddings=False))
    if name == "gemma3":
        return Gemma3ForCausalLM(_gemma3_text_config())
    if name == "gemma3mm":  # the image token ids are out of the tiny vocabulary: never prompted
        return Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=_gemma3_text_config(), vision_config=SiglipVisionConfig(**TINY_SIGLIP),
            mm_tokens_per_image=4))
    raise ValueError(f"unknown tiny model {name!r}")


def write_tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> HF directory (config.json + model.safetensors) for each of TINY_MODELS."""
    dirs: dict[str, Path] = {}
    for i, name in enumerate(TINY_MODELS):
        model = _build(name)
        _randomize(model, seed=100 + i)
        path = tmp_path_factory.mktemp(f"tiny_{name}")
        model.save_pretrained(path, safe_serialization=True)
        dirs[name] = path
    return dirs


def load_hf_reference(path: Path, name: str) -> PreTrainedModel:
    """The transformers model of tiny model `name` read back from `path` (eager attention,
    float32, eval mode)."""
    cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
           "phi3": Phi3ForCausalLM, "qwen3moe": Qwen3MoeForCausalLM,
           "qwen2moe": Qwen2MoeForCausalLM, "mixtral": MixtralForCausalLM,
           "mistral_swa": MistralForCausalLM, "gemma2": Gemma2ForCausalLM,
           "gemma3": Gemma3ForCausalLM,
           "gemma3mm": Gemma3ForConditionalGeneration}.get(name, LlamaForCausalLM)
    model = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.eval()
