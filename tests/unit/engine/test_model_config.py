"""`ModelConfig.from_hf_dict` for sliding windows, Gemma 2 and Gemma 3: each layer's window and
RoPE theta from real-shaped configs in both forms transformers writes (the classic keys as the
published config.json files have them; transformers 5's `layer_types` and per-layer-kind
`rope_parameters`), checked against transformers' own config classes; Gemma 3 4B/12B/27B's
multimodal configs read as their language model's; refusals by name; every dummy preset through
`to_hf_dict` and back."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import (
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GenerationConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

from engine.config import FULL, SLIDING, ConfigError, ModelConfig
from engine.loader.presets import PRESETS, preset_config
from engine.parallel.shard import shard_model_config

# google/gemma-2-9b's config.json as published (no tie_word_embeddings, no layer_types).
GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "sliding_window_size": 4096, "vocab_size": 256000}
# google/gemma-3-1b-it's config.json (rope_local_base_freq, sliding_window_pattern).
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
    "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "vocab_size": 262144}
# What google/gemma-3-{4b,12b,27b}-it's text_config names (only what differs from
# Gemma3TextConfig's defaults: not even the vocabulary, nor 4B's head counts).
GEMMA3_TEXT: dict[str, dict[str, Any]] = {
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34),
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                num_hidden_layers=48, num_key_value_heads=8),
    "27b": dict(head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168)}


def _gemma3_published(text: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config.json as Google published them (4.50's form)."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "sliding_window": 1024,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, **text},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def _windows(cfg: ModelConfig) -> list[int]:
    return [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]


def _hf_windows(hf: PretrainedConfig) -> list[int]:
    """Each layer's window as transformers' config lays them out (0: full attention)."""
    kinds = hf.layer_types  # type: ignore[attr-defined]
    return [hf.sliding_window if k == SLIDING else 0 for k in kinds]  # type: ignore[attr-defined]


def _transformers5(hf: PretrainedConfig) -> dict[str, Any]:
    """The config.json transformers 5 writes for `hf`: `layer_types`, `rope_parameters`."""
    d = hf.to_dict()
    assert "layer_types" in d and "rope_parameters" in d and "rope_theta" not in d
    return d


def test_gemma2_9b_alternates_windows_and_caps_scores() -> None:
    cfg = ModelConfig.from_hf_dict(GEMMA2_9B)
    assert _windows(cfg)[:4] == [4096, 0, 4096, 0]
    assert _windows(cfg) == _hf_windows(Gemma2Config(**GEMMA2_9B))
    assert {cfg.layer_rope(i) for i in range(42)} == {(10000.0, None)}
    assert cfg.attention_scale == 256 ** -0.5 == 1 / 16
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    # What transformers' class defaults to where the file says nothing.
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.is_gemma
    assert not cfg.qk_norm
    assert ModelConfig.from_hf_dict(_transformers5(Gemma2Config(**GEMMA2_9B))) == cfg


def test_gemma3_1b_local_layers_rotate_with_their_own_theta() -> None:
    cfg = ModelConfig.from_hf_dict(GEMMA3_1B)
    hf = Gemma3TextConfig(**GEMMA3_1B)
    assert _windows(cfg) == _hf_windows(hf)
    assert [i for i, w in enumerate(_windows(cfg)) if w == 0] == [5, 11, 17, 23]
    assert set(_windows(cfg)) == {512, 0}
    local, full = hf.rope_parameters[SLIDING], hf.rope_parameters[FULL]
    assert cfg.layer_rope(0) == (local["rope_theta"], None) == (10000.0, None)
    assert cfg.layer_rope(5) == (full["rope_theta"], None) == (1e6, None)
    assert cfg.qk_norm and cfg.attention_scale == 1 / 16
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (0.0, 0.0)
    assert ModelConfig.from_hf_dict(_transformers5(hf)) == cfg


def test_gemma3_12b_scales_only_the_global_layers_rope() -> None:
    old = {**preset_config("gemma-3-12b")}
    cfg = ModelConfig.from_hf_dict(old)
    assert cfg.layer_rope(0) == (10000.0, None)
    assert cfg.layer_rope(5) == (1e6, (("factor", 8.0), ("rope_type", "linear")))
    assert _windows(cfg)[:6] == [1024] * 5 + [0]
    new = _transformers5(Gemma3TextConfig(**old))
    assert new["rope_parameters"][FULL]["rope_type"] == "linear"
    assert ModelConfig.from_hf_dict(new) == cfg


@pytest.mark.parametrize("size", sorted(GEMMA3_TEXT))
def test_gemma3_multimodal_configs_read_as_their_language_model(size: str) -> None:
    """Gemma3ForConditionalGeneration reads as its text_config with transformers' defaults, the
    token ids as transformers' generation takes them (the wrapper's first)."""
    published = _gemma3_published(GEMMA3_TEXT[size])
    cfg = ModelConfig.from_hf_dict(published)
    hf = Gemma3Config(**published)
    text = hf.text_config
    assert cfg.architecture == "Gemma3ForCausalLM"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings"):
        assert getattr(cfg, key) == getattr(text, key), key
    assert cfg.attention_scale == text.query_pre_attn_scalar ** -0.5
    assert _windows(cfg) == _hf_windows(text) and set(_windows(cfg)) == {1024, 0}
    local, full = text.rope_parameters[SLIDING], text.rope_parameters[FULL]
    assert cfg.layer_rope(0) == (local["rope_theta"], None)
    assert cfg.layer_rope(5) == (full["rope_theta"], (("factor", 8.0), ("rope_type", "linear")))
    gen = GenerationConfig.from_model_config(hf)
    assert (cfg.bos_token_id, list(cfg.eos_token_ids)) == (gen.bos_token_id, gen.eos_token_id)
    assert list(cfg.eos_token_ids) == [1, 106]  # not text_config's default, 1
    assert cfg.tie_word_embeddings and hf.tie_word_embeddings
    assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg  # as transformers 5 writes it
    if size == "12b":
        assert cfg == ModelConfig.from_hf_dict(preset_config("gemma-3-12b"))


@pytest.mark.parametrize(("outer", "text", "tied"), [
    (None, None, True), (None, False, False), (False, True, False), (True, False, True)])
def test_gemma3_multimodal_head_tying(outer: bool | None, text: bool | None,
                                      tied: bool) -> None:
    """The wrapper's tie_word_embeddings decides (transformers 5 reads it; saves write it);
    without one, text_config's (transformers 4.x read that; its saves have no outer key)."""
    published = _gemma3_published(GEMMA3_TEXT["4b"])
    if outer is not None:
        published["tie_word_embeddings"] = outer
    if text is not None:
        published["text_config"]["tie_word_embeddings"] = text
    assert ModelConfig.from_hf_dict(published).tie_word_embeddings is tied


@pytest.mark.parametrize("kwargs", [
    dict(use_sliding_window=True, sliding_window=7, max_window_layers=2),
    dict(use_sliding_window=False, sliding_window=7, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=7, max_window_layers=4),
])
def test_qwen2_windows_follow_max_window_layers(kwargs: dict[str, Any]) -> None:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    classic = {"architectures": ["Qwen2ForCausalLM"], **base, **kwargs}
    hf = Qwen2Config(**base, **kwargs)
    cfg = ModelConfig.from_hf_dict(classic)
    assert _windows(cfg) == _hf_windows(hf)
    new = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]})
    assert (new.sliding_window, new.layer_types) == (cfg.sliding_window, cfg.layer_types)
    if not any(_windows(cfg)):
        assert (cfg.sliding_window, cfg.layer_types) == (None, ())


def test_qwen2_moe_and_mistral_windows() -> None:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=7)
    moe = dict(use_sliding_window=True, max_window_layers=4, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = ModelConfig.from_hf_dict({"architectures": ["Qwen2MoeForCausalLM"], **base, **moe})
    assert _windows(cfg) == _hf_windows(Qwen2MoeConfig(**base, **moe)) == [7, 0, 7, 0, 0, 0]
    # Mistral (and Mixtral, Phi-3, a GGUF's Llama) window every layer.
    cfg = ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **base})
    assert _windows(cfg) == [7] * 6
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_shards_keep_each_layers_window_and_scale() -> None:
    cfg = ModelConfig.from_hf_dict(GEMMA2_9B)
    part = shard_model_config(cfg, 2)
    assert part.num_attention_heads == 8 and _windows(part) == _windows(cfg)
    assert part.attention_scale == cfg.attention_scale
    assert part.attn_logit_softcapping == 50.0


@pytest.mark.parametrize(("change", "words"), [
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "needs a text_config"),
    ({"architectures": ["Gemma3nForConditionalGeneration"]}, "Gemma 3n"),
    ({"architectures": ["PaliGemmaForConditionalGeneration"]}, "not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": [SLIDING] * 3}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {SLIDING: {"rope_type": "linear", "factor": 2.0},
                          FULL: {"rope_type": "default"}}}, "local layers"),
])
def test_gemma_variants_refused_by_name(change: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_hf_dict({**GEMMA3_1B, **change})


def test_a_window_needs_its_layers() -> None:
    cfg = ModelConfig.from_hf_dict(GEMMA2_9B)
    with pytest.raises(ConfigError, match="layer_types"):
        cfg.replace(layer_types=()).validate()
    with pytest.raises(ConfigError, match="layer_types"):
        cfg.replace(layer_types=(SLIDING, "chunked_attention")).validate()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_dicts(name: str) -> None:
    cfg = ModelConfig.from_hf_dict(preset_config(name))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    if cfg.is_gemma:  # what `to_hf_dict` says, transformers reads the same way
        hf_cls = Gemma2Config if cfg.architecture == "Gemma2ForCausalLM" else Gemma3TextConfig
        assert _windows(cfg) == _hf_windows(hf_cls(**cfg.to_hf_dict()))
