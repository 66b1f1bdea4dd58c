"""Built-in architectures for `--load-format dummy` (random weights of real shapes).

Each preset is an HF `config.json`-style dict, so it goes through `ModelConfig.from_hf_dict`
exactly like a real checkpoint.
"""

from __future__ import annotations

from typing import Any

_LLAMA3_EOS = [128001, 128008, 128009]

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": _LLAMA3_EOS,
        "torch_dtype": "bfloat16",
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": _LLAMA3_EOS,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "torch_dtype": "bfloat16",
    },
    # Qwen3: q/k RMSNorm per head, head_dim 128 whatever hidden / heads (0.6B: 16 × 128 = 2048
    # query features over a hidden size of 1024).
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "torch_dtype": "bfloat16",
    },
    # Phi-4 (14B): Phi3ForCausalLM, checkpoints with fused qkv_proj and gate_up_proj.
    "phi-4": {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "vocab_size": 100352,
        "rms_norm_eps": 1e-5,
        "rope_theta": 250000.0,
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100265,
        "torch_dtype": "bfloat16",
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A copy of preset `name`'s HF config dict; KeyError lists the known presets."""
    if name not in PRESETS:
        raise KeyError(f"unknown dummy preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
            for k, v in PRESETS[name].items()}
