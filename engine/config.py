"""Frozen configuration, layered by consumer (DESIGN.md §5).

CLI parsing happens only at the process edge (`engine/cli.py`); defaults live here. Numbers
discovered at run time (e.g. the number of KV blocks after memory profiling) live in
`engine.runner.RunnerResult`, never written back into these objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from engine_api.errors import ConfigError
from engine_api.lora import LORA_NAME_RE
from engine_api.pooling_params import PoolerConfig

Role = Literal["colocated", "prefill", "decode"]
# The order requests are admitted, run and preempted in (engine/request_queue.py).
SchedulingPolicy = Literal["fcfs", "priority"]
BlockAllocation = Literal["auto", "lru", "runs"]
BLOCK_ALLOCATIONS: tuple[BlockAllocation, ...] = get_args(BlockAllocation)
AttentionBackendName = Literal["torch", "triton", "auto"]
KvCacheDtype = Literal["auto", "fp8", "int8"]


HiddenAct = Literal["silu", "gelu_pytorch_tanh"]
HIDDEN_ACTS: tuple[HiddenAct, ...] = get_args(HiddenAct)
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' `layer_types` values
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


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
    MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

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
        if arch in _REFUSED_ARCHITECTURES:
            raise ConfigError(f"config.json: architecture {arch!r} is not supported: "
                              f"{_REFUSED_ARCHITECTURES[arch]}")
        if arch not in cls.SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json: architecture {arch!r} is not supported; "
                f"supported: {', '.join(cls.SUPPORTED_ARCHITECTURES)}"
            )
        d = {**_HF_DEFAULTS.get(arch, {}), **d}  # what transformers' config class defaults
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
        moe = _moe_fields(arch, d)
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
            hidden_act=_hidden_act(arch, d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            weights_id=weights_id,
            **_rope_fields(arch, d),
            **_attention_layout(arch, d),
            **_gemma_fields(arch, d),
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


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config dict (empty for a dense
    architecture). Mixtral's experts are `intermediate_size` wide and always renormalised;
    Qwen2- and Qwen3-MoE name `moe_intermediate_size` and say whether to renormalise; Qwen2-MoE
    adds a gated shared expert."""
    if arch not in ModelConfig.MOE_ARCHITECTURES:
        return {}
    experts = d.get("num_experts") or d.get("num_local_experts")
    top_k = d.get("num_experts_per_tok")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"config.json: {key} must be a positive integer, got {value!r}")
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": True}
    inter = d.get("moe_intermediate_size")
    if not isinstance(inter, int) or inter <= 0:
        raise ConfigError(f"config.json: moe_intermediate_size must be a positive integer, "
                          f"got {inter!r}")
    shared = d.get("shared_expert_intermediate_size") or 0
    if shared and arch != "Qwen2MoeForCausalLM":
        raise ConfigError(f"config.json: shared_expert_intermediate_size is Qwen2-MoE's, not "
                          f"{arch}'s")
    if not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config.json: shared_expert_intermediate_size must be a "
                          f"non-negative integer, got {shared!r}")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices, "
                          f"got {only!r}")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter,
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(sorted(only)),
            "shared_expert_intermediate_size": shared}


QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# transformers' models that read `layer_types` (the others window every layer alike), and those
# whose window is on only with `use_sliding_window`.
LAYER_TYPES_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                             *GEMMA_ARCHITECTURES)
QWEN_WINDOW_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM",
                             "Qwen3MoeForCausalLM")
# Multimodal checkpoints whose language model is served alone: the wrapper's architecture -> its
# language model's. Only wrappers whose language model is one of ours, unchanged (Gemma 3's
# image tokens are ordinary ids to it), are listed; every other multimodal architecture is
# refused (below, or as unknown).
TEXT_ONLY_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# The wrapper's own config.json keys that win over its text_config's, as transformers reads
# them: generation's token ids (GenerationConfig.from_model_config takes the outer ones and
# text_config's only where those are unset) and the head's tying (transformers 5 ties by the
# outer key; 4.x, whose saves lack it, by text_config's).
_WRAPPER_KEYS = ("bos_token_id", "eos_token_id", "tie_word_embeddings")
_REFUSED_ARCHITECTURES = {
    "Gemma3nForConditionalGeneration": "Gemma 3n's decoder (per-layer embeddings, AltUp, "
    "activation sparsity) is not Gemma 3's; Gemma3ForCausalLM and Gemma 3's "
    "Gemma3ForConditionalGeneration (text only) are served",
}
# What transformers' config classes default to where a Gemma config.json says nothing (its
# published configs leave out tie_word_embeddings, Gemma 3's rope_local_base_freq and more;
# gemma-3-4b-it's text_config even the vocabulary and the head counts).
_GEMMA_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "bos_token_id": 2, "eos_token_id": 1}
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192,
                          "rope_theta": 10000.0, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "vocab_size": 262_208, "hidden_size": 2304,
                          "intermediate_size": 9216, "num_hidden_layers": 26,
                          "num_attention_heads": 8, "num_key_value_heads": 4,
                          "max_position_embeddings": 131072,
                          "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                          "sliding_window_pattern": 6},
}


CLASSIFIER_SUFFIX = "ForSequenceClassification"
MAX_CLASS_LABELS = 4096


def class_labels(d: dict[str, Any]) -> tuple[str, ...]:
    """A sequence classifier's labels as transformers reads its config: `id2label` (keys 0..n-1),
    else `num_labels` generic ones (LABEL_0, ...), else transformers' default of two."""
    id2label = d.get("id2label")
    if id2label is not None:
        if not isinstance(id2label, dict) or not id2label:
            raise ConfigError(f"config.json: id2label must be a non-empty object, got {id2label!r}")
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ConfigError("config.json: id2label's keys must be integers") from None
        if sorted(by_id) != list(range(len(by_id))):
            raise ConfigError(f"config.json: id2label's keys must be 0..{len(by_id) - 1}")
        labels = tuple(by_id[i] for i in range(len(by_id)))
    else:
        n = d.get("num_labels", 2)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"config.json: num_labels must be a positive integer, got {n!r}")
        labels = tuple(f"LABEL_{i}" for i in range(n))
    if len(labels) > MAX_CLASS_LABELS:
        raise ConfigError(f"config.json: {len(labels)} labels; at most {MAX_CLASS_LABELS}")
    return labels


def hf_architecture(d: dict[str, Any]) -> str:
    """The architecture an HF config dict names (transformers' first; Llama when none)."""
    archs = d.get("architectures") or ["LlamaForCausalLM"]
    return str(archs[0])


def language_model_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The config dict of a TEXT_ONLY_ARCHITECTURES wrapper's language model: its `text_config`
    (the defaults that apply to it are those of the text-only architecture, `_HF_DEFAULTS`), the
    wrapper's `_WRAPPER_KEYS` that it sets, and the text-only architecture."""
    arch = hf_architecture(d)
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: {arch} needs a text_config object, got {text!r}")
    outer = {key: d[key] for key in _WRAPPER_KEYS if d.get(key) is not None}
    return {**text, **outer, "architectures": [TEXT_ONLY_ARCHITECTURES[arch]]}


def _hidden_act(arch: str, d: dict[str, Any]) -> HiddenAct:
    """The MLP's activation: Gemma reads `hidden_activation` (its configs also carry a
    `hidden_act` that transformers ignores), the others `hidden_act`."""
    key = "hidden_activation" if arch in GEMMA_ARCHITECTURES else "hidden_act"
    act = d.get(key) or "silu"
    if act not in HIDDEN_ACTS:
        raise ConfigError(f"config.json: {key} {act!r} is not supported; supported: "
                          f"{', '.join(HIDDEN_ACTS)}")
    return cast(HiddenAct, act)


def _rope_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, rope_scaling and rope_local_base_freq (Gemma 3's only) from either form of an
    HF config: the classic keys, or transformers>=5's `rope_parameters` (one flat set, or Gemma
    3's one per layer kind, `full_attention` the global layers' and `sliding_attention` the
    local)."""
    rs = d.get("rope_scaling")
    theta, local = d.get("rope_theta", 10000.0), d.get("rope_local_base_freq")
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and SLIDING in rp:
        sliding = rp[SLIDING] or {}
        if sliding.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope_parameters.{SLIDING} of type "
                              f"{sliding['rope_type']!r} is not supported (the local layers' "
                              "RoPE is unscaled)")
        local = sliding.get("rope_theta", local)
        rp = rp.get(FULL)
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", theta)
        if rp.get("rope_type", "default") != "default":
            rs = {k: v for k, v in rp.items() if k != "rope_theta"}
    for partial in (d.get("partial_rotary_factor"),
                    rp.get("partial_rotary_factor") if isinstance(rp, dict) else None):
        if partial is not None and float(partial) != 1.0:  # Phi-4-mini rotates 3/4
            raise ConfigError(f"config.json: partial_rotary_factor {partial} is not "
                              "supported (every head dimension is rotated)")
    if arch != "Gemma3ForCausalLM":
        local = None
    return {"rope_theta": float(theta),
            "rope_scaling": tuple(sorted(rs.items())) if isinstance(rs, dict) else None,
            "rope_local_base_freq": float(local) if local is not None else None}


def _attention_layout(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types as transformers lays them out: `layer_types` where the
    model reads it, else the architecture's rule (`_slides`); neither when no layer slides."""
    window = d.get("sliding_window")
    if arch in QWEN_WINDOW_ARCHITECTURES and not d.get("use_sliding_window", False):
        window = None
    if not window:
        if arch in GEMMA_ARCHITECTURES:
            raise ConfigError(f"config.json: {arch} needs a positive sliding_window, got "
                              f"{window!r}")
        return {"sliding_window": None, "layer_types": ()}
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types") if arch in LAYER_TYPES_ARCHITECTURES else None
    if kinds is None:
        kinds = [SLIDING if _slides(arch, d, i) else FULL for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or not set(kinds) <= {SLIDING, FULL}:
        raise ConfigError(f"config.json: layer_types must name each of the {n} layers "
                          f"{SLIDING!r} or {FULL!r}, got {kinds!r}")
    if SLIDING not in kinds:
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": int(window), "layer_types": tuple(kinds)}


def _slides(arch: str, d: dict[str, Any], i: int) -> bool:
    """Whether layer `i` slides by transformers' rule for `arch` (configs without
    `layer_types`): Gemma 2 the even layers, Gemma 3 all but every `sliding_window_pattern`-th,
    Qwen2/3 from `max_window_layers` on, Qwen2-MoE the even layers below it, others all."""
    if arch == "Gemma2ForCausalLM":
        return i % 2 == 0
    if arch == "Gemma3ForCausalLM":
        return (i + 1) % int(d["sliding_window_pattern"]) != 0
    max_window_layers = int(d.get("max_window_layers", 28))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return i >= max_window_layers
    if arch == "Qwen2MoeForCausalLM":
        return i % 2 == 0 and i < max_window_layers
    return True


def _gemma_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma's soft caps and attention scale (empty for other architectures). Gemma 3's
    attention ignores `attn_logit_softcapping` in transformers (none of its configs set one)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    attn_cap = d.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None
    return {"attn_logit_softcapping": float(attn_cap or 0.0),
            "final_logit_softcapping": float(d.get("final_logit_softcapping") or 0.0),
            "query_pre_attn_scalar": int(d["query_pre_attn_scalar"])}


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where the weights come from."""

    model: str = ""              # path to HF dir / .gguf file, or "dummy:<preset>"; "" = default
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    seed: int = 0                # for dummy weights
    tokenizer: str | None = None  # override tokenizer path


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None   # None: sized by memory profiling
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_bytes: int = 2 << 30   # KV budget when running on the CPU
    # "fp8": float8 e4m3 storage with per-layer K/V scales (half the bytes of bf16); "int8":
    # int8 storage with per-layer K/V scales from a calibration pass (engine/attention/
    # kv_calibration.py), for GPUs without fp8 conversions (Ampere) or an int8 pipeline.
    kv_cache_dtype: KvCacheDtype = "auto"
    # Where a quantized cache's scales come from: None = the dtype's default (fp8: 1.0,
    # int8: "calibrate"), "calibrate" (a prefill of a fixed text at start-up), or the path of
    # a JSON file (`splitserve kv-scales` writes one).
    kv_scales: str | None = None
    tenant_salt: str = ""
    # Which free blocks are handed out: "lru" (least recently freed first), "runs" (prompts
    # kept in runs of consecutive ids, RunKeepingBlockPool: a KV handoff copies one run at a
    # time), "auto" (runs for the prefill and decode roles, whose prompts' KV is copied between
    # caches; lru for colocated engines).
    block_allocation: BlockAllocation = "auto"

    def validate(self) -> None:
        if self.block_allocation not in BLOCK_ALLOCATIONS:
            raise ConfigError(f"block_allocation must be one of {', '.join(BLOCK_ALLOCATIONS)}, "
                              f"got {self.block_allocation!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' (the model dtype), 'fp8' "
                              f"(float8 e4m3) or 'int8', got {self.kv_cache_dtype!r}")
        if self.kv_scales is not None and self.kv_cache_dtype == "auto":
            raise ConfigError("kv_scales applies to a quantized cache (kv_cache_dtype fp8 or "
                              "int8), not to 'auto'")
        if self.kv_scales is not None and not self.kv_scales.strip():
            raise ConfigError("kv_scales must be 'calibrate' or the path of a JSON file")
        if self.num_gpu_blocks is not None and (type(self.num_gpu_blocks) is not int
                                                or self.num_gpu_blocks < 1):
            raise ConfigError(f"num_gpu_blocks must be an integer >= 1 (or unset: sized from "
                              f"memory), got {self.num_gpu_blocks!r}")


# CPython's default thresholds (700, 10, 10) run a full collection every ~100 young ones, and a
# full collection walks every live request's token lists: ~30 ms for 1,000 requests of 2,000
# tokens on this project's CPU (tools/probes/probe_gc.py), and 43-44 of them in an offline 1000 x 1000
# run on the H200 (1.5-3.4 s, probe_tput_fp8_768g_*.json -> gc). Young collections stay
# as they were; a full one waits for 1,000 middle-generation collections instead of 10 (as
# SGLang's --gc-threshold and other engines raise them). Cycles that reach the old generation
# live longer; the engine makes few.
DEFAULT_GC_THRESHOLD = (700, 10, 1000)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching and chunked prefill."""

    max_num_seqs: int = 256                 # max requests in one step
    max_num_batched_tokens: int = 2048      # token budget of one step
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None        # None: the model's max_position_embeddings
    role: Role = "colocated"
    kv_lease_ms: int = 30_000               # prefill role: how long KV is held for decode
    # Schedule and launch step n+1 while the GPU still runs step n (sampled tokens stay on the
    # device as the next inputs). None: on for CUDA devices, except in the prefill role.
    async_scheduling: bool | None = None
    # The garbage collector's thresholds for the engine's process (gc.set_threshold), set when
    # the engine starts; None leaves the interpreter's (DEFAULT_GC_THRESHOLD says why).
    gc_threshold: tuple[int, int, int] | None = DEFAULT_GC_THRESHOLD
    # "fcfs": arrival order; "priority": each request's `priority` first (lower sooner, vLLM's
    # `--scheduling-policy priority`), with less urgent running requests preempted to admit a
    # more urgent one (engine/request_queue.py).
    policy: SchedulingPolicy = "fcfs"
    # Load shedding (a service's AsyncEngine): requests beyond `max_num_seqs` + this many in
    # flight are refused at once (EngineOverloadedError; the workers answer RESOURCE_EXHAUSTED
    # and the gateway tries another worker, then answers 429) rather than queued without bound,
    # as SGLang's --max-queued-requests. None: unbounded.
    max_queued_requests: int | None = None

    def validate(self) -> None:
        q = self.max_queued_requests
        if q is not None and (type(q) is not int or q < 0):
            raise ConfigError(f"max_queued_requests must be an integer >= 0 or None, got {q!r}")
        if self.policy not in get_args(SchedulingPolicy):
            raise ConfigError(f"scheduling policy must be one of "
                              f"{', '.join(get_args(SchedulingPolicy))}, got {self.policy!r}")
        t = self.gc_threshold
        if t is not None and (len(t) != 3 or any(type(x) is not int or x < 0 for x in t)):
            raise ConfigError(f"gc_threshold must be three integers >= 0, got {t!r}")


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the forward pass runs."""

    device: str = "auto"                    # "auto": cuda if available else cpu
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False             # True: no CUDA graphs
    # Largest decode batch captured in a CUDA graph (and not above max_num_seqs); bigger
    # decode steps run eagerly. 512 as in vLLM: each bucket costs capture time and pool memory.
    cuda_graph_max_batch: int = 512
    # Decode steps of at least this many sequences run as two micro-batches on two CUDA
    # streams, one half's attention beside the other's MLP (engine/model/overlap.py). 0: never,
    # the default: on the H200 it measured slower (docs/performance.md).
    decode_overlap_min_batch: int = 0
    quantization: Literal["none", "fp8", "int8"] = "none"
    # Intra-op threads on the CPU; None keeps torch's default. Several engines (or an engine and
    # its tests) on one small machine must split the cores, or spinning thread pools oversubscribe
    # them and small ops get ~100x slower.
    cpu_threads: int | None = None
    # Other steps of at most this many tokens (prompts and chunks, decodes beside them) replay
    # piecewise CUDA graphs: each layer's norms, matmuls, RoPE and KV write from a graph per
    # token-count bucket, attention launched eagerly between them (engine/piecewise_graphs.py).
    # On the H200 (8B): a prompt's first token 15-17 ms eager -> 5.3-12.2 ms for 5-512 tokens.
    # 0: off.
    piecewise_graph_max_tokens: int = 512

    def validate(self) -> None:
        n = self.piecewise_graph_max_tokens
        if type(n) is not int or not (n == 0 or 16 <= n <= MAX_PIECEWISE_GRAPH_TOKENS):
            raise ConfigError(f"piecewise_graph_max_tokens must be 0 (off) or in "
                              f"[16, {MAX_PIECEWISE_GRAPH_TOKENS}], got {n!r}")


# Past ~2k tokens a step's kernels outlast its eager launches (a 1,024-token prompt: 20.5 ms of
# kernels against ~2 ms of gaps on the H200), so graphs gain nothing and cost pool memory.
MAX_PIECEWISE_GRAPH_TOKENS = 2048


SpecMethod = Literal["none", "ngram", "draft_model"]
SPEC_METHODS: tuple[SpecMethod, ...] = get_args(SpecMethod)  # "none" first

# Each draft is one more query row per sequence in the verify step; beyond a handful the
# acceptance of the last drafts is small and the step's extra rows cost more than they save.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/): a proposer drafts tokens, the target model verifies
    them all in one step, and a rejection sampler keeps the target's distribution exactly.

    `method` enables the capability; each request may then ask for fewer drafts, or none (the
    gateway turns it off under load). "ngram" is prompt lookup: the longest suffix of the
    sequence, `prompt_lookup_max` down to `prompt_lookup_min` tokens long, that occurred earlier
    proposes the tokens that followed it (vLLM's `ngram` method). "draft_model" runs `model`, a
    smaller model with the target's vocabulary, greedily for the drafts (vLLM's draft model;
    engine/draft_model.py); it runs on the target's device with its own KV cache."""

    method: SpecMethod = "none"
    num_speculative_tokens: int = 4     # drafts per step at most
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # A request whose verify steps recently accepted fewer drafts than this per step (moving
    # average) pauses drafting for SPEC_PROBE_INTERVAL steps, then tries again: below it a
    # verify step costs more than the tokens it saves. Measured break-even with 4 drafts: 0.32
    # on an H200 at batch 1 (a verify step costs 1.32 decode steps,
    # bench/results/h200/ab_verify_decode_*_6f732f8.json), 0.53 on this project's CPU
    # (bench/results/cpu_probe_spec_smollm2.json). 0: never pause.
    min_accepted_per_step: float = 0.4
    # method "draft_model": the draft's weights (a path, or "dummy:<preset>" as for the target).
    model: str = ""
    # The draft's share of the device's memory (its weights, activations and KV cache; the
    # target's KV cache is sized after it). Ignored on the CPU, where the draft's cache takes
    # `CacheConfig.cpu_kv_cache_bytes` as the target's does.
    draft_gpu_memory_utilization: float = 0.1

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative method must be 'none', 'ngram' or 'draft_model', got "
                              f"{self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative method 'draft_model' needs the draft's `model` (a path "
                              "or dummy:<preset>)")
        if not 0.0 < self.draft_gpu_memory_utilization < 1.0:
            raise ConfigError("draft_gpu_memory_utilization must be in (0, 1), got "
                              f"{self.draft_gpu_memory_utilization!r}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                              f"got {self.num_speculative_tokens}")
        floor = self.min_accepted_per_step
        if not isinstance(floor, (int, float)) or not 0 <= floor <= self.num_speculative_tokens:
            raise ConfigError("min_accepted_per_step must be in [0, num_speculative_tokens], got "
                              f"{self.min_accepted_per_step!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("prompt lookup n-gram sizes must satisfy 1 <= prompt_lookup_min <= "
                              f"prompt_lookup_max, got {self.prompt_lookup_min} and "
                              f"{self.prompt_lookup_max}")


# Adapters' ranks above this are refused (vLLM's --max-lora-rank default is 16; PEFT adapters in
# use rarely exceed 64, and each rank costs every adapted row two thin matmuls per projection).
DEFAULT_MAX_LORA_RANK = 64
# Slots are allocated in every projection of every layer: a ceiling that catches a typo.
MAX_LORAS = 64


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (engine/lora/): PEFT adapters loaded at start, each request choosing
    one by name (or none) — vLLM's `--enable-lora --lora-modules name=path`. The adapters'
    deltas are added to the projections they target (q/k/v/o, gate/up/down) for the rows of
    the requests that chose them; every other row computes the base model."""

    modules: tuple[tuple[str, str], ...] = ()  # (name, adapter directory)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    # Adapter slots on the device (vLLM's --max-loras). 0: exactly `modules`, packed (the
    # least work per step), none added later. > 0: that many slots of rank `max_lora_rank`,
    # `modules` in the first, adapters loaded and unloaded at runtime
    # (`LLMEngine.add_lora` / `remove_lora`) — every projection then pays for every slot.
    max_loras: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or self.max_loras > 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.modules)

    def validate(self) -> None:
        if type(self.max_lora_rank) is not int or not 1 <= self.max_lora_rank <= 1024:
            raise ConfigError(f"max_lora_rank must be an integer in [1, 1024], got "
                              f"{self.max_lora_rank!r}")
        if type(self.max_loras) is not int or not 0 <= self.max_loras <= MAX_LORAS:
            raise ConfigError(f"max_loras must be an integer in [0, {MAX_LORAS}], got "
                              f"{self.max_loras!r}")
        if self.max_loras and len(self.modules) > self.max_loras:
            raise ConfigError(f"{len(self.modules)} LoRA modules given for max_loras "
                              f"{self.max_loras} slots")
        seen: set[str] = set()
        for name, path in self.modules:
            if not isinstance(name, str) or not LORA_NAME_RE.match(name):
                raise ConfigError(f"LoRA adapter name {name!r} must be 1-128 characters of "
                                  "letters, digits and . _ : - (starting with a letter or digit)")
            if name in seen:
                raise ConfigError(f"LoRA adapter name {name!r} is given twice")
            if not isinstance(path, str) or not path:
                raise ConfigError(f"LoRA adapter {name!r} needs a directory")
            seen.add(name)


# Beyond a host's GPUs; a ceiling that catches a typo before it spawns processes.
MAX_TENSOR_PARALLEL_SIZE = 16


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism (engine/parallel/): the model's attention heads and MLP columns split
    over `tensor_parallel_size` processes, one device each (`cuda:0` … on a GPU host; CPU
    processes otherwise), as Megatron-LM lays a decoder out and vLLM's `--tensor-parallel-size`
    does. The engine's process is rank 0: it schedules, samples and holds its own shard; the
    other ranks are worker processes that run each forward pass on theirs."""

    tensor_parallel_size: int = 1
    # How long a collective (a step's all-reduce, a command's broadcast) may wait for the other
    # ranks before it fails instead of hanging: a dead or stuck worker turns into an error.
    collective_timeout_s: float = 300.0

    @property
    def layout(self) -> str:
        """The layout of the KV blocks the engine hands out, in the model fingerprint
        (DESIGN.md §4): every KV head of a layer in the model's order, whatever the
        tensor-parallel size — a split cache's blocks are gathered whole as they leave and
        scattered to the ranks as they enter (engine/parallel/). So workers of different sizes
        share KV: a prefill worker at tp 4 hands its prompts to a decode worker at tp 1."""
        return "heads-whole"

    def validate(self) -> None:
        n = self.tensor_parallel_size
        if type(n) is not int or not 1 <= n <= MAX_TENSOR_PARALLEL_SIZE:
            raise ConfigError(f"tensor_parallel_size must be an integer in "
                              f"[1, {MAX_TENSOR_PARALLEL_SIZE}], got {n!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got "
                              f"{self.collective_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    pooler: PoolerConfig = field(default_factory=PoolerConfig)

    def keeps_block_runs(self) -> bool:
        """Whether the KV pool keeps prompts in runs of consecutive blocks (CacheConfig's
        `block_allocation`; "auto": where KV is handed to or from another cache)."""
        mode = self.cache.block_allocation
        return mode == "runs" or (mode == "auto" and self.scheduler.role != "colocated")
