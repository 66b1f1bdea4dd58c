"""Loader tests: HF safetensors (single + sharded), GGUF (tiny written here + SmolLM2), dummy, errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.config import ConfigError, LoadConfig
from engine.loader import ModelLoadError, ModelSource, load_model_source
from engine.loader.gguf_file import unpermute_qk
from engine.loader.load import DEFAULT_GGUF, default_model_path

TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256)


def _weights(source: ModelSource) -> dict[str, torch.Tensor]:
    assert source.weights is not None
    out: dict[str, torch.Tensor] = {}
    for name, t in source.weights():
        assert name not in out, f"{name} yielded twice"
        out[name] = t
    return out


def _expected_state(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        sd.pop("lm_head.weight")
    return sd


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path, Path]:
    torch.manual_seed(0)
    # transformers>=5 writes RoPE settings as config.json `rope_parameters`
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    cfg = LlamaConfig(**TINY, bos_token_id=1, eos_token_id=[2, 3], rms_norm_eps=1e-5,
                      tie_word_embeddings=False, rope_parameters=rope)
    model = LlamaForCausalLM(cfg)
    single = tmp_path_factory.mktemp("llama_single")
    sharded = tmp_path_factory.mktemp("llama_sharded")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="50KB")
    return model, single, sharded


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen2ForCausalLM, Path]:
    torch.manual_seed(1)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True, rope_parameters=rope))
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3ForCausalLM, Path]:
    """Qwen3: q/k norms, head_dim 32 over a hidden size of 64 with 4 heads (not hidden / heads)."""
    torch.manual_seed(2)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True,
                                         rope_parameters=rope))
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module")
def tiny_phi3() -> Phi3ForCausalLM:
    """Phi-3: fused qkv_proj and gate_up_proj, untied output."""
    torch.manual_seed(3)
    rope = {"rope_type": "default", "rope_theta": 1e4}
    return Phi3ForCausalLM(Phi3Config(**TINY, tie_word_embeddings=False, rope_parameters=rope,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2))


# ---- Hugging Face directories ------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_hf_llama_weights_and_config(tiny_llama: tuple, layout: str) -> None:
    model, single, sharded = tiny_llama
    path = single if layout == "single" else sharded
    if layout == "sharded":
        assert (path / "model.safetensors.index.json").exists()
        assert len(list(path.glob("*.safetensors"))) > 2
    source = load_model_source(LoadConfig(model=str(path)))
    got, want = _weights(source), _expected_state(model, tied=False)
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    c = source.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "LlamaForCausalLM", 128, 64, 96)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2, 4, 2, 16)
    assert c.rope_theta == 5000.0 and c.rms_norm_eps == 1e-5
    assert c.rope_scaling_dict is not None and c.rope_scaling_dict["factor"] == 8.0
    assert c.rope_scaling_dict["rope_type"] == "llama3"
    assert not c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == (2, 3)
    assert str(Path(path).resolve()) in c.weights_id
    assert source.default_dtype == torch.float32 and source.dummy_seed is None
    assert source.tokenizer_source is None  # no tokenizer.json saved


def test_hf_qwen2_bias_and_tied(tiny_qwen2: tuple) -> None:
    model, path = tiny_qwen2
    source = load_model_source(LoadConfig(model=str(path)))
    got, want = _weights(source), _expected_state(model, tied=True)
    assert set(got) == set(want)
    assert "model.layers.1.self_attn.k_proj.bias" in got and "lm_head.weight" not in got
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    c = source.config
    assert c.architecture == "Qwen2ForCausalLM" and c.attention_bias and c.tie_word_embeddings
    assert c.rope_theta == 1e6 and c.rope_scaling is None


@pytest.mark.parametrize(("change", "words"), [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.75}}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "default",
                                                          "rope_theta": 1e4}},
     "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_variants_are_refused_by_name(change: dict[str, Any], words: str) -> None:
    """Phi-4-mini's partial rotary and an MLP activation other than SiLU or GELU-tanh would load
    and compute something else: refused when the config is read."""
    from engine.config import ConfigError, ModelConfig

    base = {"architectures": ["Phi3ForCausalLM"], **TINY}
    ModelConfig.from_hf_dict(base)  # the plain one loads
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_hf_dict({**base, **change})


def test_phi3_checkpoint_names_are_the_fused_ones() -> None:
    from engine.config import ModelConfig
    from engine.loader.source import expected_weight_names

    names = expected_weight_names(ModelConfig.from_hf_dict(
        {"architectures": ["Phi3ForCausalLM"], **TINY}))
    assert "model.layers.1.self_attn.qkv_proj.weight" in names
    assert "model.layers.1.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


def test_hf_qwen3_norms_and_head_dim(tiny_qwen3: tuple) -> None:
    model, path = tiny_qwen3
    source = load_model_source(LoadConfig(model=str(path)))
    got, want = _weights(source), _expected_state(model, tied=True)
    assert set(got) == set(want)
    assert "model.layers.1.self_attn.q_norm.weight" in got
    c = source.config
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and not c.attention_bias
    assert (c.num_attention_heads, c.head_dim, c.hidden_size) == (4, 32, 64)
    # A checkpoint without the norms is refused by name, not loaded with norms of ones.
    from engine.loader.source import check_weight_names
    with pytest.raises(ModelLoadError, match="q_norm"):
        check_weight_names({n for n in got if "q_norm" not in n}, c, "ckpt")


def test_weights_stream_is_lazy_and_repeatable(tiny_llama: tuple) -> None:
    _, _, sharded = tiny_llama
    source = load_model_source(LoadConfig(model=str(sharded)))
    assert source.weights is not None
    first = next(iter(source.weights()))
    again = dict(source.weights())
    torch.testing.assert_close(again[first[0]], first[1])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_generation_config_and_chat_template(tiny_llama: tuple, tmp_path: Path) -> None:
    path = _copy(tiny_llama[1], tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7],
                                                            "temperature": 0.6}))
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    source = load_model_source(LoadConfig(model=str(path)))
    assert source.config.eos_token_ids == (2, 3, 7)
    assert source.generation_config["temperature"] == 0.6
    assert source.chat_template == "D"
    # A multimodal checkpoint's processor file (Gemma 3 4B+), when the tokenizer has none.
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert load_model_source(LoadConfig(model=str(path))).chat_template == "P"
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    (path / "chat_template.jinja").write_text("J")
    source = load_model_source(LoadConfig(model=str(path)))
    assert source.config.eos_token_ids == (2, 3, 9) and source.chat_template == "J"


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nope"):
        load_model_source(LoadConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model_source(LoadConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                     **TINY}))
    with pytest.raises(ModelLoadError, match="no safetensors"):
        load_model_source(LoadConfig(model=str(tmp_path)))


@pytest.mark.parametrize("damage", ["truncate", "header", "garbage"])
def test_corrupt_safetensors_named(tiny_llama: tuple, tmp_path: Path, damage: str) -> None:
    path = _copy(tiny_llama[2], tmp_path / "m")
    shard = sorted(path.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) - 100])
    elif damage == "header":
        shard.write_bytes((2**40).to_bytes(8, "little") + data[8:])
    else:
        shard.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model_source(LoadConfig(model=str(path)))


def test_missing_tensor_named(tiny_llama: tuple, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_llama[1], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model_source(LoadConfig(model=str(path)))


def test_missing_shard_named(tiny_llama: tuple, tmp_path: Path) -> None:
    path = _copy(tiny_llama[2], tmp_path / "m")
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model_source(LoadConfig(model=str(path)))


def test_unsupported_architecture(tiny_llama: tuple, tmp_path: Path) -> None:
    path = _copy(tiny_llama[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_model_source(LoadConfig(model=str(path)))


# ---- GGUF ---------------------------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute (with n_head already set to n_head_kv for K)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in [(4, 16, 8), (9, 64, 3), (3, 64, 1)]:
        w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        permuted = _llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)
    bias = rng.standard_normal(4 * 16).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(bias, 4), 4), bias)


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def _to_gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if not hf.startswith("model.layers."):
        return top.get(hf, hf)  # llama.cpp's own tensors (rope_factors_long.weight) as they are
    _, _, layer, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"


def _write_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], cfg: dict) -> None:
    """A GGUF as llama.cpp's converter writes it: F32 tensors, Q/K permuted for llama."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(cfg["rope_theta"])
    if "rope_dims" in cfg:
        w.add_rope_dimension_count(cfg["rope_dims"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("expert_count"):
        w.add_expert_count(cfg["expert_count"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in state.items():
        a = t.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = _llama_cpp_permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            a = _llama_cpp_permute(a, cfg["num_key_value_heads"])
        w.add_tensor(_to_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_roundtrip(tiny_llama: tuple, tiny_qwen2: tuple, tiny_qwen3: tuple,
                             tmp_path: Path, arch: str) -> None:
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}[arch][0]
    tied = arch != "llama"
    head_dim = 32 if arch == "qwen3" else 16
    want = _expected_state(model, tied=tied)
    path = tmp_path / f"tiny-{arch}.gguf"
    extra = {"head_dim": head_dim} if arch == "qwen3" else {}
    _write_gguf(path, arch, want, {**TINY, "rope_theta": 5000.0, **extra})
    source = load_model_source(LoadConfig(model=str(path)))
    got = _weights(source)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    c = source.config
    assert c.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (
        4, 2, head_dim, 128)
    assert c.tie_word_embeddings == tied and c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert c.rope_theta == 5000.0 and c.max_position_embeddings == 256
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert source.default_dtype == torch.float32 and source.tokenizer_source == str(path)


def test_moe_gguf_is_refused_by_name(tiny_llama: tuple, tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as "llama" with an expert count: refused, not read as dense."""
    path = tmp_path / "mixtral.gguf"
    _write_gguf(path, "llama", _expected_state(tiny_llama[0], tied=False),
                {**TINY, "rope_theta": 1e6, "expert_count": 8})
    with pytest.raises(ModelLoadError, match="expert_count 8: mixture-of-experts GGUF"):
        load_model_source(LoadConfig(model=str(path)))


def test_tiny_phi3_gguf_roundtrip(tiny_phi3: Phi3ForCausalLM, tmp_path: Path) -> None:
    """llama.cpp's "phi3" (Phi-3, Phi-4): fused attn_qkv / ffn_up tensors become the fused
    checkpoint's qkv_proj / gate_up_proj as they are (not permuted), the sliding window comes
    along; partial rotary and LongRoPE are refused by name."""
    want = _expected_state(tiny_phi3, tied=False)
    assert any(".gate_up_proj." in n for n in want) and any(".qkv_proj." in n for n in want)
    cfg = {**TINY, "rope_theta": 1e4, "rope_dims": 16, "sliding_window": 200}
    path = tmp_path / "tiny-phi3.gguf"
    _write_gguf(path, "phi3", want, cfg)
    source = load_model_source(LoadConfig(model=str(path)))
    got = _weights(source)
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    c = source.config
    assert c.architecture == "Phi3ForCausalLM" and c.fused_checkpoint
    assert (c.head_dim, c.sliding_window, c.tie_word_embeddings) == (16, 200, False)
    partial = tmp_path / "partial.gguf"
    _write_gguf(partial, "phi3", want, {**cfg, "rope_dims": 12})
    with pytest.raises(ModelLoadError, match=r"rope\.dimension_count 12 .* partial rotary"):
        load_model_source(LoadConfig(model=str(partial)))
    longrope = tmp_path / "longrope.gguf"
    _write_gguf(longrope, "phi3", {**want, "rope_factors_long.weight": torch.ones(8)}, cfg)
    with pytest.raises(ModelLoadError, match="LongRoPE"):
        load_model_source(LoadConfig(model=str(longrope)))


def test_corrupt_gguf_named(tiny_llama: tuple, tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    _write_gguf(good, "llama", _expected_state(tiny_llama[0], tied=False),
                {**TINY, "rope_theta": 5000.0})
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(64))
    header_only = tmp_path / "header_only.gguf"
    header_only.write_bytes(data[:200])
    for bad in (truncated, garbage, header_only):
        with pytest.raises(ModelLoadError, match=bad.name):
            load_model_source(LoadConfig(model=str(bad)))


_GEMMA3_GGUF_NAMES = {**_GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"}


def test_tiny_gemma3_gguf_roundtrip(tmp_path: Path) -> None:
    """llama.cpp's "gemma3": its four norms per layer by their llama.cpp names, stored as 1 + w
    (llama.cpp's converter adds Gemma's 1), read back as the checkpoint's w; what the reader
    fixes rather than reads (window pattern 6, local RoPE base 10k, GELU-tanh, attention scale
    1/sqrt(head_dim)) in the config."""
    torch.manual_seed(4)
    cfg = {**TINY, "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 64,
           "rope_theta": 1e6}
    model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg, query_pre_attn_scalar=32))
    want = _expected_state(model, tied=True)
    for name in want:  # random norm weights (transformers starts them at 0, i.e. a scale of 1)
        if name.endswith("norm.weight"):
            want[name] = torch.randn_like(want[name]) * 0.5
    stored = {n: t + 1 if n.endswith("norm.weight") else t for n, t in want.items()}
    path = tmp_path / "tiny-gemma3.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    for add, key in ((w.add_block_count, "num_hidden_layers"),
                     (w.add_context_length, "max_position_embeddings"),
                     (w.add_embedding_length, "hidden_size"),
                     (w.add_feed_forward_length, "intermediate_size"),
                     (w.add_head_count, "num_attention_heads"),
                     (w.add_head_count_kv, "num_key_value_heads"), (w.add_key_length, "head_dim"),
                     (w.add_rope_freq_base, "rope_theta"), (w.add_sliding_window, "sliding_window")):
        add(cfg[key])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(cfg["vocab_size"])
    for name, t in stored.items():
        layer = name.split(".", 3)
        gguf_name = (f"blk.{layer[2]}.{_GEMMA3_GGUF_NAMES[layer[3].rpartition('.')[0]]}.weight"
                     if name.startswith("model.layers.") else _to_gguf_name(name))
        w.add_tensor(gguf_name, t.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    source = load_model_source(LoadConfig(model=str(path)))
    got = _weights(source)
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6, msg=name)
    c = source.config
    assert c.architecture == "Gemma3ForCausalLM" and c.is_gemma and c.qk_norm
    assert c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
    assert (c.head_dim, c.query_pre_attn_scalar, c.sliding_window) == (32, 32, 64)
    assert (c.rope_theta, c.rope_local_base_freq, c.final_logit_softcapping) == (1e6, 1e4, 0.0)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)


@pytest.mark.parametrize(("arch", "words"), [("gpt2", "gpt2"),
                                            ("gemma2", r"'gemma2'.*Hugging Face directory")])
def test_gguf_unsupported_architecture(tmp_path: Path, arch: str, words: str) -> None:
    """Refused by name; Gemma's GGUF files with where Gemma loads from (its safetensors)."""
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=words):
        load_model_source(LoadConfig(model=str(path)))


def test_smollm2_gguf_matches_transformers() -> None:
    """Default model: config from metadata; dequantized + un-permuted weights equal transformers'."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    assert os.path.basename(path) == DEFAULT_GGUF
    source = load_model_source(LoadConfig(model=""))
    c = source.config
    assert (c.architecture, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        "LlamaForCausalLM", 576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert source.chat_template is not None and "<|im_start|>" in source.chat_template
    assert source.tokenizer_source == path

    folder, filename = os.path.split(path)
    hf_cfg = AutoConfig.from_pretrained(folder, gguf_file=filename)
    with torch.device("meta"):
        ref_model = AutoModelForCausalLM.from_config(hf_cfg)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=ref_model)["tensors"]
    ref.pop("lm_head.weight", None)
    got = _weights(source)
    assert set(got) == set(ref)
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t.float(), rtol=0, atol=1e-6, msg=name)


def test_gguf_reader_reads_what_the_stock_reader_reads() -> None:
    """open_gguf's plain-view reader: every field (types, parts, decoded value) and every tensor
    (type, shape, offset, bytes) of the default model equal gguf.GGUFReader's."""
    from engine_api.gguf_meta import open_gguf

    path = default_model_path()
    ours, stock = open_gguf(path), gguf.GGUFReader(path, "r")
    assert type(ours) is not gguf.GGUFReader and list(ours.fields) == list(stock.fields)
    for key, want in stock.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), key
        assert [(p.dtype, p.tobytes()) for p in got.parts] == [
            (p.dtype, p.tobytes()) for p in want.parts], key
        assert got.contents() == want.contents(), key
    assert len(ours.tensors) == len(stock.tensors) > 0
    for got_t, want_t in zip(ours.tensors, stock.tensors, strict=True):
        assert (got_t.name, got_t.tensor_type, got_t.data_offset, got_t.n_bytes) == (
            want_t.name, want_t.tensor_type, want_t.data_offset, want_t.n_bytes)
        assert got_t.shape.tolist() == want_t.shape.tolist()
        assert got_t.data.dtype == want_t.data.dtype and got_t.data.shape == want_t.data.shape
        assert np.array_equal(got_t.data, want_t.data), got_t.name


def test_gguf_metadata_is_read_once_per_version_of_the_file(tmp_path: Path) -> None:
    """`read_metadata` holds every field's value as the stock reader decodes it; the weights'
    reader that skips the fields (to where the metadata said the tensors start) has the same
    tensors as the stock reader; a changed file is read again."""
    from engine_api.gguf_meta import open_gguf, read_metadata

    path = str(tmp_path / "model.gguf")
    shutil.copyfile(default_model_path(), path)
    stock = gguf.GGUFReader(path, "r")
    meta = read_metadata(path)
    assert read_metadata(path) is meta
    assert list(meta.values) == list(stock.fields)
    for key, field in stock.fields.items():
        want = field.contents()
        assert meta.values[key] == (tuple(want) if isinstance(want, list) else want), key
    assert meta.tensor_names == {t.name for t in stock.tensors}
    skipping = open_gguf(path, meta)
    assert list(skipping.fields) == ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"] + (
        ["general.alignment"] if "general.alignment" in stock.fields else [])
    assert skipping.data_offset == stock.data_offset
    for got_t, want_t in zip(skipping.tensors, stock.tensors, strict=True):
        assert (got_t.name, got_t.tensor_type, got_t.data_offset, got_t.n_bytes) == (
            want_t.name, want_t.tensor_type, want_t.data_offset, want_t.n_bytes)
        assert np.array_equal(got_t.data, want_t.data), got_t.name
    del stock, skipping
    with open(path, "ab") as f:  # another version of the file: its metadata is read again
        f.write(b"\0" * 64)
    assert read_metadata(path) is not meta


# ---- dummy --------------------------------------------------------------------------------------

def test_dummy_presets() -> None:
    s = load_model_source(LoadConfig(model="dummy:llama-3.1-8b", seed=7))
    c = s.config
    assert s.weights is None and s.tokenizer_source is None and s.dummy_seed == 7
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (4096, 14336, 32)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (32, 8, 128, 128256)
    assert c.rope_theta == 500000.0 and c.max_position_embeddings == 131072
    assert c.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert not c.tie_word_embeddings and s.default_dtype == torch.bfloat16
    assert "dummy" in c.weights_id and "7" in c.weights_id

    c = load_model_source(LoadConfig(model="dummy:llama-3.2-1b")).config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.head_dim) == (2048, 8192, 16, 64)
    assert c.tie_word_embeddings and c.rope_scaling_dict is not None
    assert c.rope_scaling_dict["factor"] == 32.0

    c = load_model_source(LoadConfig(model="dummy:qwen2.5-0.5b")).config
    assert c.architecture == "Qwen2ForCausalLM" and c.attention_bias and c.tie_word_embeddings
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (896, 4864, 24)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (14, 2, 64, 151936)
    assert c.rope_theta == 1e6

    c = load_model_source(LoadConfig(model="dummy:qwen3-8b")).config
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and not c.attention_bias
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (4096, 12288, 36)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (
        32, 8, 128, 151936)
    c = load_model_source(LoadConfig(model="dummy:qwen3-0.6b")).config
    assert (c.hidden_size, c.num_attention_heads, c.head_dim) == (1024, 16, 128)  # 2048 q features

    c = load_model_source(LoadConfig(model="dummy:phi-4")).config
    assert c.architecture == "Phi3ForCausalLM" and c.fused_checkpoint and not c.qk_norm
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (
        5120, 40, 40, 128)

    c = load_model_source(LoadConfig(model="dummy:tiny")).config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (4, 2, 512)

    with pytest.raises(ModelLoadError, match=r"llama-3\.1-8b"):
        load_model_source(LoadConfig(model="dummy:gpt-5"))


def test_dummy_from_config_dir(tiny_qwen2: tuple) -> None:
    _, path = tiny_qwen2
    s = load_model_source(LoadConfig(model=str(path), load_format="dummy", seed=3))
    assert s.weights is None and s.dummy_seed == 3
    assert s.config.architecture == "Qwen2ForCausalLM" and s.config.hidden_size == 64
    assert s.default_dtype == torch.float32
