"""The model's architecture (`ModelConfig`, read from a Hugging Face `config.json` by
engine/config/hf.py) and where its weights come from (`LoadConfig`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast

from engine.config.hf import (
    CLASSIFIER_SUFFIX,
    FULL,
    GEMMA_ARCHITECTURES,
    HF_DEFAULTS,
    HIDDEN_ACTS,
    LAYER_TYPES_ARCHITECTURES,
    MOE_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QWEN_WINDOW_ARCHITECTURES,
    REFUSED_ARCHITECTURES,
    SLIDING,
    TEXT_ONLY_ARCHITECTURES,
    HiddenAct,
    attention_layout,
    class_labels,
    gemma_fields,
    hf_architecture,
    language_model_dict,
    moe_fields,
    parse_hidden_act,
    rope_fields,
)
from engine_api.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Phi-3/Phi-4,
    SmolLM2, Gemma 2, Gemma 3 text), or of one whose MLPs are mixtures of experts (Mixtral,
    Qwen2-MoE, Qwen3-MoE).

    Field names follow Hugging Face `config.json` so `from_hf_dict` is a thin mapping. A
    multimodal checkpoint of TEXT_ONLY_ARCHITECTURES (Gemma 3 4B/12B/27B,
    Gemma3ForConditionalGeneration) reads as its language model (`language_model_dict`): text
    in, text out; its vision tower and projector are not loaded.
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` dict as a sorted tuple of items (hashable); None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v bias
    qk_norm: bool = False         # Qwen3, Gemma 3: RMSNorm over each head of q and k, pre-RoPE
    mlp_bias: bool = False
    # Sliding-window attention: the layers `layer_types` marks SLIDING see the last
    # `sliding_window` positions (themselves included), the others every position. Both unset
    # (None, ()) when no layer slides; else `layer_types` names every layer (`from_hf_dict`
    # derives it as transformers does: Mistral all layers, Qwen2 from max_window_layers on,
    # Gemma 2 every other one, Gemma 3 five of six).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: HiddenAct = "silu"  # the gated MLP's activation (Gemma: GELU, tanh approximated)
    # Gemma: scores become c * tanh(s / c) before the softmax (attention, Gemma 2) and the
    # logits likewise (final); 0: off.
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: int | None = None
    # Gemma 3: RoPE theta of the sliding layers, unscaled (the others use rope_theta and
    # rope_scaling); None: every layer uses rope_theta.
    rope_local_base_freq: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: every MLP is dense. A sparse
    # layer's router picks num_experts_per_tok experts per token out of num_experts, each a
    # SiLU-gated MLP of moe_intermediate_size; norm_topk_prob renormalises the picked experts'
    # softmax weights to sum to 1. Qwen3-MoE keeps dense MLPs (intermediate_size) in the
    # layers `mlp_only_layers` names and those not on the decoder_sparse_step grid.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a dense SiLU-gated MLP of this size beside the routed experts, its output
    # scaled by sigmoid(shared_expert_gate · x) (0: none).
    shared_expert_intermediate_size: int = 0
    # A sequence classifier (transformers' `*ForSequenceClassification`: the decoder, then a
    # `score` matrix of one row per label over the last position's final hidden state, and no
    # LM head): its labels in id order. Empty: a causal LM.
    class_labels: tuple[str, ...] = ()
    # Identity of the weights (path + size + mtime, or "dummy:<seed>"); part of the fingerprint.
    weights_id: str = ""

    SUPPORTED_ARCHITECTURES = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        *GEMMA_ARCHITECTURES,
    )
    MOE_ARCHITECTURES = MOE_ARCHITECTURES

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], weights_id: str = "") -> ModelConfig:
        arch = hf_architecture(d)
        if arch in TEXT_ONLY_ARCHITECTURES:
            return cls.from_hf_dict(language_model_dict(d), weights_id)
        if arch.endswith(CLASSIFIER_SUFFIX):
            causal = arch.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
            if causal not in cls.SUPPORTED_ARCHITECTURES:
                raise ConfigError(f"config.json: architecture {arch!r} is not supported: "
                                  f"{causal} is not")
            # No LM head: the logits a step computes (and ignores) come from the embedding.
            body = cls.from_hf_dict({**d, "architectures": [causal], "tie_word_embeddings": True},
                                    weights_id)
            return dataclasses.replace(body, class_labels=class_labels(d))
        if arch in REFUSED_ARCHITECTURES:
            raise ConfigError(f"config.json: architecture {arch!r} is not supported: "
                              f"{REFUSED_ARCHITECTURES[arch]}")
        if arch not in cls.SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json: architecture {arch!r} is not supported; "
                f"supported: {', '.join(cls.SUPPORTED_ARCHITECTURES)}"
            )
        d = {**HF_DEFAULTS.get(arch, {}), **d}  # what transformers' config class defaults
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise ConfigError(f"config.json: {key} must be a positive integer, got {d.get(key)!r}")
        if d.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention (an embedding model) is "
                              "not supported; the engine serves causal decoders")
        n_heads = d["num_attention_heads"]
        n_kv = d.get("num_key_value_heads") or n_heads
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        is_qwen2 = arch == "Qwen2ForCausalLM"
        moe = moe_fields(arch, d)
        cfg = cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2-MoE names its q/k/v bias `qkv_bias` (on unless said otherwise).
            attention_bias=bool(d.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM"
                                else d.get("attention_bias", is_qwen2)),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=parse_hidden_act(arch, d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            weights_id=weights_id,
            **rope_fields(arch, d),
            **attention_layout(arch, d),
            **gemma_fields(arch, d),
            **moe,
        )
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent HF config dict (used to build the `transformers` reference in tests)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
                           "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                           "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma2ForCausalLM": "gemma2",
                           "Gemma3ForCausalLM": "gemma3_text"}.get(self.architecture, "llama"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.eos_token_ids else None,
        }
        if self.is_moe:
            d.update(num_local_experts=self.num_experts, num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok)
            if self.architecture != "MixtralForCausalLM":
                d.update(moe_intermediate_size=self.moe_intermediate_size,
                         norm_topk_prob=self.norm_topk_prob,
                         decoder_sparse_step=self.decoder_sparse_step,
                         mlp_only_layers=list(self.mlp_only_layers))
            if self.architecture == "Qwen2MoeForCausalLM":
                d.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                         qkv_bias=self.attention_bias)
        d.update(self._attention_hf_keys())
        if self.class_labels:
            d["architectures"] = [self.architecture.removesuffix("ForCausalLM") + CLASSIFIER_SUFFIX]
            d["id2label"] = dict(enumerate(self.class_labels))
        if self.is_gemma:
            d.update(hidden_activation=self.hidden_act,
                     query_pre_attn_scalar=self.query_pre_attn_scalar,
                     attn_logit_softcapping=self.attn_logit_softcapping or None,
                     final_logit_softcapping=self.final_logit_softcapping or None)
            if self.rope_local_base_freq is not None:
                d["rope_local_base_freq"] = self.rope_local_base_freq
        elif self.hidden_act != "silu":
            d["hidden_act"] = self.hidden_act
        return d

    def _attention_hf_keys(self) -> dict[str, Any]:
        """`to_hf_dict`'s sliding-window keys: none for a model without (so its fingerprint is
        what it was before windows existed); Gemma's layer kinds always (its defaults would
        make layers slide)."""
        d: dict[str, Any] = {}
        if self.sliding_window is None and not self.is_gemma:
            return d
        d["sliding_window"] = self.sliding_window
        if self.architecture in LAYER_TYPES_ARCHITECTURES:
            d["layer_types"] = list(self.layer_types or (FULL,) * self.num_hidden_layers)
        if self.architecture in QWEN_WINDOW_ARCHITECTURES:
            d["use_sliding_window"] = True
        return d

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be a positive even integer, got {self.head_dim}")
        if self.qk_norm != (self.architecture in QK_NORM_ARCHITECTURES):
            raise ConfigError(f"qk_norm is Qwen3's and Gemma 3's (architecture "
                              f"{self.architecture!r})")
        if self.hidden_act not in HIDDEN_ACTS or (self.is_moe and self.hidden_act != "silu"):
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                              f"{', '.join(HIDDEN_ACTS)} (experts: silu)")
        self._validate_attention()
        if self.is_moe != (self.architecture in self.MOE_ARCHITECTURES):
            raise ConfigError(f"num_experts {self.num_experts}: architecture "
                              f"{self.architecture!r} is "
                              f"{'' if self.is_moe else 'not '}a mixture of experts")
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok must be in [1, num_experts "
                                  f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be "
                                  "positive")

    def _validate_attention(self) -> None:
        kinds, window = self.layer_types, self.sliding_window
        if kinds and (len(kinds) != self.num_hidden_layers or not set(kinds) <= {SLIDING, FULL}):
            raise ConfigError(f"layer_types must name each of the {self.num_hidden_layers} "
                              f"layers {SLIDING!r} or {FULL!r}, got {list(kinds)}")
        if (SLIDING in kinds) != (window is not None):
            raise ConfigError(f"sliding_window ({window}) and layer_types must come together: a "
                              f"window for the layers marked {SLIDING!r}")
        if window is not None and (type(window) is not int or window <= 0):
            raise ConfigError(f"sliding_window must be a positive integer, got {window!r}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if not getattr(self, name) >= 0.0:
                raise ConfigError(f"{name} must be >= 0 (0: off), got {getattr(self, name)!r}")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive (or unset), got {value!r}")

    @property
    def is_classifier(self) -> bool:
        """A `*ForSequenceClassification` checkpoint: it pools and classifies, never generates."""
        return bool(self.class_labels)

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 / 3's structure: RMSNorms scale by (1 + weight), 'sandwich' norms around
        attention and the MLP, embeddings scaled by sqrt(hidden_size)."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def attention_scale(self) -> float:
        """The softmax scale: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_idx: int) -> int:
        """Decoder layer `layer_idx`'s sliding window (what `PagedAttentionBackend.attend`
        takes): `sliding_window` for a sliding layer, 0 for full attention."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING:
            return cast(int, self.sliding_window)
        return 0

    def layer_rope(self, layer_idx: int) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
        """(theta, rope_scaling) of decoder layer `layer_idx`: Gemma 3's sliding layers rotate
        with rope_local_base_freq, unscaled; every other layer with rope_theta and rope_scaling."""
        if self.rope_local_base_freq is not None and self.layer_window(layer_idx):
            return self.rope_local_base_freq, None
        return self.rope_theta, self.rope_scaling

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx`'s MLP is a mixture of experts (Qwen3-MoE's rule:
        not in `mlp_only_layers` and on the `decoder_sparse_step` grid)."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def fused_checkpoint(self) -> bool:
        """Whether checkpoints hold the fused `qkv_proj` and `gate_up_proj` (Phi-3) rather
        than q/k/v and gate/up apart."""
        return self.architecture == "Phi3ForCausalLM"

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where the weights come from."""

    model: str = ""              # path to HF dir / .gguf file, or "dummy:<preset>"; "" = default
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    seed: int = 0                # for dummy weights
    tokenizer: str | None = None  # override tokenizer path
