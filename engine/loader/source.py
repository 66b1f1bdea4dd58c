"""What a loader hands to the engine: architecture, a weight stream, tokenizer and template."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import ModelConfig

WeightStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class ModelSource:
    """Everything the engine needs from a model path, without having read the weights yet.

    `weights()` starts a fresh stream each call; it yields `(hf_name, tensor)` pairs in Hugging
    Face naming (`model.layers.0.self_attn.q_proj.weight`; a multimodal checkpoint's language
    model under its text-only names, `loaded_weight_name`), un-permuted, as a float dtype that
    the model casts. Shards are read one at a time, so peak memory is one shard (or one GGUF
    tensor).
    """

    config: ModelConfig
    weights: WeightStream | None            # None for dummy weights
    tokenizer_source: str | None            # tokenizer.json or .gguf path; None for dummy
    chat_template: str | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    default_dtype: torch.dtype = torch.float32
    dummy_seed: int | None = None           # set for dummy weights


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The HF parameter names a Llama-family (or Gemma) checkpoint with this config must
    provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    if config.is_classifier:
        names.append("score.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.is_gemma:
            names += [p + "pre_feedforward_layernorm.weight",
                      p + "post_feedforward_layernorm.weight"]
        attn = ("qkv_proj", "o_proj") if config.fused_checkpoint else (
            "q_proj", "k_proj", "v_proj", "o_proj")
        for proj in attn:
            names.append(f"{p}self_attn.{proj}.weight")
        if config.attention_bias:
            names += [f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
        if config.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        if config.is_sparse_layer(i):
            names += _expert_names(config, p)
            continue
        mlp = ("gate_up_proj", "down_proj") if config.fused_checkpoint else (
            "gate_proj", "up_proj", "down_proj")
        for proj in mlp:
            names.append(f"{p}mlp.{proj}.weight")
            if config.mlp_bias:
                names.append(f"{p}mlp.{proj}.bias")
    return names


def _expert_names(config: ModelConfig, layer: str) -> list[str]:
    """A sparse layer's router and per-expert tensors as its architecture's checkpoints name
    them (Mixtral: block_sparse_moe, w1/w3/w2; Qwen2/3-MoE: mlp, gate/up/down_proj, and
    Qwen2-MoE's shared expert and its gate)."""
    if config.architecture == "MixtralForCausalLM":
        block, projs = f"{layer}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, projs = f"{layer}mlp.", ("gate_proj", "up_proj", "down_proj")
    names = [f"{block}gate.weight"] + [f"{block}experts.{e}.{proj}.weight"
                                       for e in range(config.num_experts) for proj in projs]
    if config.shared_expert_intermediate_size:
        names += [f"{block}shared_expert.{proj}.weight" for proj in projs]
        names.append(f"{block}shared_expert_gate.weight")
    return names


def is_skipped_weight(name: str, config: ModelConfig) -> bool:
    """Names a checkpoint may carry that the model does not load."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


# Where a Gemma3ForConditionalGeneration checkpoint keeps its language model: the original
# saves (and transformers 5's, which writes that layout back) under `language_model.model.`,
# an untied head under `language_model.lm_head.`; transformers 4.52-4.57's under
# `model.language_model.`, the head at `lm_head.` already.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
# The multimodal parts beside it, in either layout.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.",
                    "model.vision_tower.", "model.multi_modal_projector.")


def language_model_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as its language model's text-only checkpoint names
    it; None for the vision tower's and the projector's (the engine serves text). Any other name
    is returned unchanged, so that the model still refuses it as unexpected."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, text_prefix in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return text_prefix + name[len(prefix):]
    return name


def loaded_weight_name(name: str, config: ModelConfig, multimodal: bool) -> str | None:
    """The name checkpoint tensor `name` is loaded as (`multimodal`: of a TEXT_ONLY_ARCHITECTURES
    checkpoint); None for a tensor the model does not load."""
    loaded = language_model_weight_name(name) if multimodal else name
    return None if loaded is None or is_skipped_weight(loaded, config) else loaded


def check_weight_names(available: set[str], config: ModelConfig, where: str) -> None:
    """Raise ModelLoadError naming the tensors `config` needs that `available` lacks."""
    from engine_api.errors import ModelLoadError

    missing = [n for n in expected_weight_names(config) if n not in available]
    if missing:
        shown = ", ".join(missing[:8]) + (f" … ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ModelLoadError(f"{where}: missing tensors: {shown}")


def dtype_from_name(name: object) -> torch.dtype | None:
    """torch dtype for a config.json `torch_dtype`/`dtype` string; None when absent/unknown."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float": torch.float32, "half": torch.float16}
    return table.get(str(name).removeprefix("torch.")) if name is not None else None
