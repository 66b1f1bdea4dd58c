"""Reading a Hugging Face `config.json` into `ModelConfig`'s fields: which architectures are
served and how each spells its attention layout, RoPE, activation, experts and Gemma's
extras, and the defaults transformers fills in where a config says nothing.
"""

from __future__ import annotations

from typing import Any, Literal, cast, get_args

from engine_api.errors import ConfigError

HiddenAct = Literal["silu", "gelu_pytorch_tanh"]
HIDDEN_ACTS: tuple[HiddenAct, ...] = get_args(HiddenAct)
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' `layer_types` values
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config dict (empty for a dense
    architecture). Mixtral's experts are `intermediate_size` wide and always renormalised;
    Qwen2- and Qwen3-MoE name `moe_intermediate_size` and say whether to renormalise; Qwen2-MoE
    adds a gated shared expert."""
    if arch not in MOE_ARCHITECTURES:
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
REFUSED_ARCHITECTURES = {
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
HF_DEFAULTS: dict[str, dict[str, Any]] = {
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
    (the defaults that apply to it are those of the text-only architecture, `HF_DEFAULTS`), the
    wrapper's `_WRAPPER_KEYS` that it sets, and the text-only architecture."""
    arch = hf_architecture(d)
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: {arch} needs a text_config object, got {text!r}")
    outer = {key: d[key] for key in _WRAPPER_KEYS if d.get(key) is not None}
    return {**text, **outer, "architectures": [TEXT_ONLY_ARCHITECTURES[arch]]}


def parse_hidden_act(arch: str, d: dict[str, Any]) -> HiddenAct:
    """The MLP's activation: Gemma reads `hidden_activation` (its configs also carry a
    `hidden_act` that transformers ignores), the others `hidden_act`."""
    key = "hidden_activation" if arch in GEMMA_ARCHITECTURES else "hidden_act"
    act = d.get(key) or "silu"
    if act not in HIDDEN_ACTS:
        raise ConfigError(f"config.json: {key} {act!r} is not supported; supported: "
                          f"{', '.join(HIDDEN_ACTS)}")
    return cast(HiddenAct, act)


def rope_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
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


def attention_layout(arch: str, d: dict[str, Any]) -> dict[str, Any]:
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


def gemma_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma's soft caps and attention scale (empty for other architectures). Gemma 3's
    attention ignores `attn_logit_softcapping` in transformers (none of its configs set one)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    attn_cap = d.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None
    return {"attn_logit_softcapping": float(attn_cap or 0.0),
            "final_logit_softcapping": float(d.get("final_logit_softcapping") or 0.0),
            "query_pre_attn_scalar": int(d["query_pre_attn_scalar"])}
