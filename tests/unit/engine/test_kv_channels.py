"""Per-channel factors of an int8 KV cache (engine/attention/kv_channels.py): how they are
computed, the scales file that carries them, the fingerprint they enter, and an int8 engine
whose K/V have outlier channels against the float cache, with and without them.

The Triton backend's path with factors: tests/kernels/test_rope_kv_write.py; piecewise graphs:
tests/unit/engine/test_piecewise_graphs.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.kv_calibration import kv_scales_document, load_kv_scales, round_scales
from engine.attention.kv_channels import (
    K_HEADROOM,
    MIN_FACTOR,
    V_HEADROOM,
    channel_factors,
    pair_max,
    qk_dot_on_int8,
)
from engine.config import ConfigError
from engine.llm import LLM
from tests.support.engine_driver import tiny_llm

# ---- the factors ------------------------------------------------------------------------------


def test_factors_are_relative_headroomed_floored_and_equal_across_rope_pairs() -> None:
    d = 8
    amax = torch.full((2, 2, 2, d), 1.0)
    amax[0, 0, 1, 2] = 20.0     # K outlier: channel 2 of head 1, partner 6
    amax[0, 0, 0, 5] = 3.0      # partner 1
    amax[0, 1, 0, 3] = 10.0     # V outlier: channel 3 only
    amax[0, 1, 1, 0] = 0.0      # a silent V channel: floored
    amax[1] = 0.0               # a silent layer: 1.0
    f = channel_factors(amax)
    assert f.shape == amax.shape
    k, v = f[0, 0], f[0, 1]
    assert torch.equal(k[..., :d // 2], k[..., d // 2:])  # RoPE pairs (i, i + D/2)
    assert k[1, 2] == k[1, 6] == round_scales(torch.tensor(K_HEADROOM))
    assert k[0, 1] == k[0, 5] == round_scales(torch.tensor(K_HEADROOM * 3 / 20))
    assert k[0, 0] == round_scales(torch.tensor(K_HEADROOM / 20))
    assert v[0, 3] == round_scales(torch.tensor(V_HEADROOM))
    assert v[0, 2] == round_scales(torch.tensor(V_HEADROOM / 10))
    assert v[1, 0] == MIN_FACTOR and v[1, 1] == round_scales(torch.tensor(V_HEADROOM / 10))
    assert torch.equal(f[1], torch.ones_like(f[1]))
    assert torch.equal(round_scales(f), f)  # already on the 4-bit grid: workers agree
    assert torch.equal(pair_max(torch.tensor([1.0, 5.0, 3.0, 2.0])),
                       torch.tensor([3.0, 5.0, 3.0, 5.0]))
    with pytest.raises(ValueError, match="D even"):
        channel_factors(torch.ones(1, 2, 1, 3))


def test_the_largest_channel_gets_exactly_the_headroom() -> None:
    """A layer's largest channel is its headroom whatever its value: in float32 5.7155313 *
    1.5 / 5.7155313 rounds to just above 1.5, which the 4-bit rounding up made 1.625 (and a
    tensor-parallel group, whose maxima differ in the last bit, 1.5)."""
    x = 5.715531349182129
    assert float(torch.tensor(x) * 1.5 / torch.tensor(x)) > 1.5  # the premise
    amax = torch.full((1, 2, 1, 4), 1.0)
    amax[0, 1, 0, 1] = x
    assert channel_factors(amax)[0, 1, 0, 1] == V_HEADROOM


def test_no_calibrated_factors_where_the_decode_qk_dot_rounds_q_to_int8(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton decode kernel on a GPU runs an int8 cache's QK dot on int8 for head_dim <= 128
    (unless SPLITSERVE_INT8_QK=0): there calibration keeps one scale per layer."""
    from engine.kernels.decode_attention import int8_qk_requested

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    int8_qk_requested.cache_clear()
    monkeypatch.setenv("SPLITSERVE_INT8_QK", "1")
    assert qk_dot_on_int8(cuda, "triton", 128)
    assert not qk_dot_on_int8(cuda, "triton", 256)  # the fp16 QK path
    assert not qk_dot_on_int8(cuda, "torch", 128) and not qk_dot_on_int8(cpu, "triton", 64)
    int8_qk_requested.cache_clear()
    monkeypatch.setenv("SPLITSERVE_INT8_QK", "0")
    assert not qk_dot_on_int8(cuda, "triton", 128)
    int8_qk_requested.cache_clear()


# ---- an engine with outlier channels -----------------------------------------------------------

OUTLIER = 40.0


@pytest.fixture(scope="module")
def outlier_model(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> Path:
    """The tiny Llama with, in every layer, one K channel pair of KV head 0 and one V channel of
    KV head 1 made OUTLIER times larger (their k_proj / v_proj rows scaled): each layer's
    largest |K| and |V| then sit in channels the others are far below."""
    src = tiny_model_dirs["llama"]
    dst = tmp_path_factory.mktemp("tiny_llama_outliers")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    d = config["hidden_size"] // config["num_attention_heads"]
    weights = load_file(src / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("k_proj.weight"):
            w[[3, 3 + d // 2]] *= OUTLIER
        elif name.endswith("v_proj.weight"):
            w[d + 5] *= OUTLIER
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    return llm.engine.runner.prefill_logits(tokens)


def test_factors_bring_int8_closer_to_the_float_cache(outlier_model: Path,
                                                      tmp_path: Path) -> None:
    """Teacher-forced logits (every position reads its K/V back from the cache): the int8 cache
    with channel factors against one with the same per-layer scales only (a per-layer file),
    each against the float32 cache. Measured: mean relative L2 error 0.032 with factors, 0.52
    without; the bound (a fifth) leaves room either way."""
    tokens = [(7 * i + 3) % 384 for i in range(48)]
    ref = _logits(tiny_llm(outlier_model, max_model_len=64), tokens)
    per_channel = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="int8")
    runner = per_channel.engine.runner
    factors = runner.kv_channel_factors
    assert factors is not None and float(factors.min()) < 0.2  # the outliers were found
    path = tmp_path / "layer.json"
    path.write_text(json.dumps(kv_scales_document(runner.kv_scales, "int8")))
    per_layer = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="int8",
                         kv_scales=str(path))
    assert per_layer.engine.runner.kv_channel_factors is None
    assert torch.equal(per_layer.engine.runner.kv_scales, runner.kv_scales)

    def error(llm: LLM) -> float:
        got = _logits(llm, tokens)
        return float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())

    with_factors, without = error(per_channel), error(per_layer)
    assert with_factors < without / 5, (with_factors, without)


# ---- the scales file --------------------------------------------------------------------------

def _channel_file(tmp_path: Path, scales: torch.Tensor, factors: torch.Tensor) -> Path:
    path = tmp_path / "channel.json"
    path.write_text(json.dumps(kv_scales_document(scales, "int8", factors)))
    return path


def test_channel_file_round_trip_sets_the_engine_and_its_fingerprint(
        outlier_model: Path, tmp_path: Path) -> None:
    engine = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="int8").engine
    runner = engine.runner
    cfg = runner.model_config
    factors = runner.kv_channel_factors
    assert factors is not None
    path = _channel_file(tmp_path, runner.kv_scales, factors)
    doc = json.loads(path.read_text())
    assert doc["granularity"] == "channel"
    assert len(doc["k_channel_factors"][0]) == cfg.num_key_value_heads
    scales, loaded = load_kv_scales(path, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim)
    assert torch.equal(scales, runner.kv_scales) and loaded is not None
    assert torch.equal(loaded, factors)
    # The same file: the same factors, the same fingerprint (workers exchange KV).
    same = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="int8",
                    kv_scales=str(path)).engine
    assert torch.equal(same.runner.kv_channel_factors, factors)
    assert same.fingerprint == engine.fingerprint
    # Other factors (one channel pair doubled): another fingerprint; no factors: another yet.
    other = factors.clone()
    other[0, 0, 0, [0, cfg.head_dim // 2]] *= 2
    changed = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="int8",
                       kv_scales=str(_channel_file(tmp_path, runner.kv_scales, other))).engine
    layer_path = tmp_path / "layer.json"
    layer_path.write_text(json.dumps(kv_scales_document(runner.kv_scales, "int8")))
    per_layer = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="int8",
                         kv_scales=str(layer_path)).engine
    assert len({engine.fingerprint, changed.fingerprint, per_layer.fingerprint}) == 3
    # An fp8 cache keeps one scale per layer, whatever the file holds.
    fp8 = tiny_llm(outlier_model, max_model_len=64, kv_cache_dtype="fp8",
                   kv_scales=str(path)).engine
    assert fp8.runner.kv_channel_factors is None
    assert torch.equal(fp8.runner.kv_scales, runner.kv_scales)


def test_old_per_layer_files_load_with_unit_factors(tmp_path: Path) -> None:
    path = tmp_path / "old.json"  # as written before channel factors: no granularity
    path.write_text(json.dumps({"kv_cache_dtype": "int8", "k_scale": [0.5, 0.25],
                                "v_scale": [0.125, 1.0]}))
    scales, factors = load_kv_scales(path, 2, 1, 4)
    assert scales.tolist() == [[0.5, 0.125], [0.25, 1.0]] and factors is None


def _doc(**changes: object) -> str:
    doc: dict[str, object] = {
        "granularity": "channel", "k_scale": [1.0, 1.0], "v_scale": [1.0, 1.0],
        "k_channel_factors": [[[0.5, 1.0, 0.5, 1.0]], [[1.0, 1.0, 1.0, 1.0]]],
        "v_channel_factors": [[[0.5, 1.0, 0.25, 1.0]], [[1.0, 1.0, 1.0, 1.0]]]}
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize("content,match", [
    (_doc(granularity="head"), "'granularity' must be one of layer, channel"),
    (_doc(k_channel_factors=None), "'k_channel_factors' must be a list of 2 layers"),
    (_doc(v_channel_factors=[[[1.0] * 4], [[1.0] * 4], [[1.0] * 4]]), "a list of 2 layers"),
    (_doc(v_channel_factors=[[[1.0] * 4, [1.0] * 4], [[1.0] * 4]]), "a list of 1 heads"),
    (_doc(k_channel_factors=[[[1.0] * 3], [[1.0] * 4]]), "a list of 4 numbers"),
    (_doc(v_channel_factors=[[[1.0, 0.0, 1.0, 1.0]], [[1.0] * 4]]), "positive finite"),
    (_doc(v_channel_factors=[[[1.0, "x", 1.0, 1.0]], [[1.0] * 4]]), "positive finite"),
    (_doc(k_channel_factors=[[[0.5, 1.0, 1.0, 1.0]], [[1.0] * 4]]), "equal across RoPE pairs"),
])
def test_bad_channel_files_are_config_errors(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_kv_scales(path, 2, 1, 4)
    path.write_text(_doc())
    _, factors = load_kv_scales(path, 2, 1, 4)  # the unchanged document is valid
    assert factors is not None and factors[0, 1, 0].tolist() == [0.5, 1.0, 0.25, 1.0]
