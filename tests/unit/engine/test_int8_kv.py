"""int8 KV cache on the CPU (torch backend): quantization, calibrated and file scales, engine
accuracy against the float32 cache, block read/write with re-quantization.

The Triton kernels' int8 paths are tested in tests/kernels/test_kernels.py and tests/kernels/test_rope_kv_write.py
(interpreter) and on the GPU by tools/gpu/gpu_kernels_check.py; the wire and the disaggregated pull
in tests/unit/engine/test_fp8_kv.py (parametrized over fp8 and int8).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engine.attention.kv_calibration import (
    calibration_token_ids,
    kv_scales_document,
    load_kv_scales,
    round_scales,
)
from engine.attention.kv_channels import channel_factors, layer_amax
from engine.attention.kv_quant import INT8_KV_MAX, quantize_int8, scales_from_amax
from engine.attention.torch_backend import TorchAttentionBackend, write_kv_torch
from engine.cli_args import add_engine_args, engine_config_from_args
from engine.config import CacheConfig, ConfigError
from engine.kernels import reference as R
from engine.llm import LLM
from tests.support.engine_driver import (
    greedy,
    mixed_step_metadata,
    run_to_end,
    teacher_forced_agreement,
    tiny_llm,
)

INT8 = torch.int8


def _int8_llm(path: Path, **kwargs: object) -> LLM:
    return tiny_llm(path, kv_cache_dtype="int8", max_model_len=64, **kwargs)


# ---- quantization -----------------------------------------------------------------------------

def test_quantize_rounds_half_away_and_saturates_symmetrically() -> None:
    x = torch.tensor([0.0, 0.5, -0.5, 1.5, -2.5, 0.49, 126.4, 127.6, -1e6, 3.0])
    q = quantize_int8(x, 1.0)
    assert q.tolist() == [0, 1, -1, 2, -3, 0, 126, 127, -127, 3]
    assert torch.equal(quantize_int8(x * 0.25, 0.25), q)  # x / scale, a power of two: exact
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4096, generator=g) * 30
    assert torch.equal(quantize_int8(y, 0.37), R.quantize_int8_ref(y, 0.37))


def test_write_kv_torch_matches_reference_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(3)
    cache = torch.zeros(2, 6, 4, 2, 16, dtype=INT8)
    ref = cache.clone()
    key = torch.randn(9, 2, 16, generator=g) * 10  # past 127 * 0.05: saturated
    value = torch.randn(9, 2, 16, generator=g)
    slots = torch.tensor([3, 0, 22, -1, 7, 8, 13, 1, 23])
    write_kv_torch(key, value, cache, slots, 0.05, 0.02)
    R.write_kv_ref(key, value, ref, slots, 0.05, 0.02)
    assert torch.equal(cache, ref)
    assert cache[0].abs().max() == 127
    assert cache[0].reshape(-1, 2, 16).abs().sum(dim=(1, 2)).count_nonzero() == 8


def test_torch_backend_int8_matches_dequantized_reference_and_the_float_cache() -> None:
    g = torch.Generator().manual_seed(4)
    nb, bs, hkv, d, h = 8, 4, 2, 16, 4
    md = mixed_step_metadata(bs)
    tables = md.block_tables
    prior = torch.randn(2, nb, bs, hkv, d, generator=g)
    q, k, v = (torch.randn(6, n, d, generator=g) for n in (h, hkv, hkv))
    k_scale, v_scale = 4.0 / 127, 3.5 / 127  # ~the largest |K|, |V| of these normals
    cache = torch.stack((quantize_int8(prior[0], k_scale), quantize_int8(prior[1], v_scale)))
    out = TorchAttentionBackend().forward(q, k, v, cache, md, 0.25, (k_scale, v_scale))
    want = R.paged_attention_ref(q, cache, md.query_start_loc, md.seq_lens, tables, 0.25,
                                 k_scale, v_scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    exact = TorchAttentionBackend().forward(q, k, v, prior.clone(), md, 0.25)
    assert ((out - exact).norm() / exact.norm()) < 0.03  # steps of 1/127 of the range


# ---- scales -----------------------------------------------------------------------------------

def test_scales_from_amax_round_up_to_four_significant_bits() -> None:
    amax = torch.tensor([[12.7, 1.0], [0.0, 3.3]])
    scales = scales_from_amax(amax, INT8)
    assert torch.equal(scales[1, 0], torch.tensor(1.0))  # a silent layer keeps 1.0
    rounded = round_scales(scales)
    assert torch.all(rounded >= scales) and torch.all(rounded <= scales * (1 + 1 / 8))
    for s in rounded.reshape(-1).tolist():  # 4 significant bits: s * 2**k is an integer < 16
        mantissa = s
        while mantissa < 8:
            mantissa *= 2
        while mantissa >= 16:
            mantissa /= 2
        assert mantissa == int(mantissa)
    assert torch.equal(round_scales(rounded), rounded)  # idempotent
    # Two passes that differ in the last bits give the same scales (unless a scale sits right
    # at a step of the grid, as the silent layer's 1.0 does).
    fitted = scales[0]
    assert torch.equal(round_scales(fitted * (1 + 1e-6)), round_scales(fitted))


def test_engine_calibrates_int8_scales_at_start(tiny_model_dirs: dict[str, Path]) -> None:
    llm = _int8_llm(tiny_model_dirs["llama"])
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == INT8 and runner.kv_is_quantized
    assert runner.block_bytes == runner.kv_cache[:, :, 0].numel()
    ids = calibration_token_ids(None, runner.model_config.vocab_size)[:64]
    cfg = runner.model_config
    channels = runner.measure_kv_amax(ids)
    assert channels.shape == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
    amax = layer_amax(channels)
    assert bool((amax > 0).all())
    # The calibrated scales cover each layer's largest |K| and |V| within 127 steps, with at
    # most 1/8 to spare (4-bit rounding up).
    scales = runner.kv_scales
    assert torch.all(scales * INT8_KV_MAX >= amax)
    assert torch.all(scales * INT8_KV_MAX <= amax * (1 + 1 / 8))
    assert runner.kv_scale_values == [tuple(r) for r in scales.tolist()]
    again = _int8_llm(tiny_model_dirs["llama"]).engine.runner.kv_scales
    assert torch.equal(again, scales)  # deterministic: workers agree
    fp8 = tiny_llm(tiny_model_dirs["llama"], kv_cache_dtype="fp8", max_model_len=64)
    assert torch.equal(fp8.engine.runner.kv_scales, torch.ones_like(scales))  # fp8: 1.0


def test_calibration_prompt_uses_the_chat_template(smollm2: LLM) -> None:
    tok = smollm2.engine.tokenizer
    assert tok is not None
    ids = calibration_token_ids(tok, smollm2.engine.model_config.vocab_size)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "Rotterdam" in text and "def fib" in text and "<|im_start|>assistant" in text
    assert calibration_token_ids(None, 100, 50) == calibration_token_ids(None, 100, 50)
    assert all(0 <= i < 100 for i in calibration_token_ids(None, 100, 50))


def test_scales_file_round_trip_and_engine_use(tiny_model_dirs: dict[str, Path],
                                              tmp_path: Path) -> None:
    runner = _int8_llm(tiny_model_dirs["llama"]).engine.runner
    layers = runner.model_config.num_hidden_layers
    scales = torch.tensor([[0.01 * (i + 1), 0.02] for i in range(layers)])
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(kv_scales_document(scales, "int8")))
    cfg = runner.model_config
    loaded, factors = load_kv_scales(path, layers, cfg.num_key_value_heads, cfg.head_dim)
    assert torch.equal(loaded, scales) and factors is None  # a per-layer file
    llm = _int8_llm(tiny_model_dirs["llama"], kv_scales=str(path))
    assert torch.equal(llm.engine.runner.kv_scales, scales)
    assert llm.engine.runner.kv_channel_factors is None
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], greedy(3))[0].outputs[0].token_ids
    assert len(out) == 3
    fp8 = tiny_llm(tiny_model_dirs["llama"], kv_cache_dtype="fp8", max_model_len=64,
                   kv_scales=str(path))  # a file also sets fp8 scales
    assert torch.equal(fp8.engine.runner.kv_scales, scales)


@pytest.mark.parametrize("content,match", [
    ("not json", "is not JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"k_scale": [1.0], "v_scale": [1.0, 1.0]}', "'k_scale' must be a list of 2"),
    ('{"k_scale": [1.0, -2.0], "v_scale": [1.0, 1.0]}', "positive finite"),
    ('{"k_scale": [1.0, true], "v_scale": [1.0, 1.0]}', "positive finite"),
    ('{"k_scale": [1.0, 1.0]}', "'v_scale' must be a list"),
])
def test_bad_scales_files_are_config_errors(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_kv_scales(path, 2, 1, 4)


def test_scales_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read KV scales file"):
        load_kv_scales(tmp_path / "missing.json", 2, 1, 4)
    with pytest.raises(ConfigError, match="applies to a quantized cache"):
        CacheConfig(kv_scales="calibrate").validate()
    with pytest.raises(ConfigError, match="'calibrate' or the path"):
        CacheConfig(kv_cache_dtype="int8", kv_scales=" ").validate()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--kv-cache-dtype", "int8",
                                                "--kv-scales", "calibrate"]))
    assert cfg.cache.kv_cache_dtype == "int8" and cfg.cache.kv_scales == "calibrate"


# ---- accuracy ---------------------------------------------------------------------------------

def test_tiny_model_logits_close_to_float32_cache(tiny_model_dirs: dict[str, Path]) -> None:
    """Teacher-forced logits of every position (chunked prefill: cached prefixes), int8 cache
    with calibrated scales vs the float32 cache. Tolerance: relative L2 error per position
    <= 10%, <= 5% on average (measured: see the assertion message on failure)."""
    path = tiny_model_dirs["llama"]
    tokens = [(7 * i + 3) % 384 for i in range(40)]
    logits = []
    for dtype in ("auto", "int8"):
        engine = tiny_llm(path, max_model_len=64, kv_cache_dtype=dtype,
                          max_num_batched_tokens=16).engine
        engine.add_request("r", tokens, greedy(1))
        logits.append(run_to_end(engine)["r"].logits_matrix())
    ref, got = logits
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 0.10 and rel.mean() < 0.05, rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_smollm2_greedy_agrees_teacher_forced(smollm2: LLM) -> None:
    """SmolLM2-135M with calibrated int8 scales: the float32 cache's greedy continuation, fed to
    the int8 engine, is its own argmax at >= 90% of positions (the fp8 test's bar)."""
    int8 = LLM(num_gpu_blocks=512, device="cpu", kv_cache_dtype="int8",
               enable_prefix_caching=False)
    agree, total = teacher_forced_agreement(smollm2, int8)
    assert agree / total >= 0.9, f"{agree}/{total}"


# ---- blocks -----------------------------------------------------------------------------------

def test_write_read_blocks_requantize_and_refuse_other_quantized_dtypes(
        tiny_model_dirs: dict[str, Path]) -> None:
    runner = _int8_llm(tiny_model_dirs["llama"]).engine.runner
    ours = runner.kv_scales.view(1, -1, 2, 1, 1, 1)
    shape = (2, *runner.kv_shape_per_block)
    g = torch.Generator().manual_seed(5)
    values = torch.randn(shape, generator=g) * ours * 60
    values[0, 0, 0, 0, 0, 0] = 1e4  # past 127 * scale: saturates
    runner.write_blocks([3, 1], values)  # float blocks: quantized with the runner's scales
    got = runner.read_blocks([3, 1])
    assert got.dtype == INT8 and got.shape == shape
    assert got[0, 0, 0, 0, 0, 0] == 127
    factors = runner.kv_channel_factors  # ... and its channel factors
    assert factors is not None
    assert torch.equal(got, quantize_int8(values / factors.unsqueeze(2).unsqueeze(0), ours))
    runner.write_blocks([5], got[:1])  # int8 blocks under the same scales: copied bitwise
    assert torch.equal(runner.read_blocks([5]), got[:1])
    # int8 blocks under other scales are re-quantized to ours: values kept within half a step,
    # those past our range saturated.
    other = runner.kv_scales * 2
    theirs = quantize_int8(values[1:], other.view(1, -1, 2, 1, 1, 1))
    runner.write_blocks([6], theirs, scales=other)
    back = runner.read_blocks([6]).float() * ours
    limit = ours * INT8_KV_MAX
    want = torch.maximum(torch.minimum(theirs.float() * other.view(1, -1, 2, 1, 1, 1), limit),
                         -limit)
    assert bool(((back - want).abs() <= ours / 2 + 1e-6).all())
    with pytest.raises(ValueError, match=r"cannot enter a torch\.int8 cache"):
        runner.write_blocks([6], got[:1].view(torch.uint8).view(torch.float8_e4m3fn))


# ---- splitserve kv-scales -----------------------------------------------------------------------

def test_kv_scales_command_writes_what_the_engine_calibrates(tiny_model_dirs: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """Without --text the command measures the engine's own calibration prompt, so the file
    holds exactly the scales an int8 engine computes at start; with --text, the scales cover
    that text's K/V and an engine started with the file uses them."""
    from splitserve.cli import main

    model = str(tiny_model_dirs["llama"])
    base = ["--model", model, "--dtype", "float32", "--device", "cpu", "--kv-cache-dtype",
            "int8", "--max-model-len", "64"]
    out = tmp_path / "scales.json"
    assert main(["kv-scales", "--out", str(out), *base]) == 0
    engine = _int8_llm(tiny_model_dirs["llama"]).engine
    cfg = engine.runner.model_config
    scales, factors = load_kv_scales(out, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                     cfg.head_dim)
    assert torch.equal(scales, engine.runner.kv_scales)
    assert factors is not None and torch.equal(factors, engine.runner.kv_channel_factors)
    assert json.loads(out.read_text())["calibration"]["tokens"] == 64  # the prompt, cut to 64
    assert main(["kv-scales", "--out", str(out), "--model", model, "--device", "cpu"]) == 2
    assert main(["kv-scales", "--out", str(out), "--text", str(tmp_path), *base]) == 2


def test_kv_scales_command_calibrates_on_a_text(tmp_path: Path, smollm2: LLM) -> None:
    """--text (the embedded SmolLM2, which has a tokenizer): the scales cover the text's own K/V
    chunk by chunk, within 1/8 to spare (measured here with the session's SmolLM2 engine: the
    K/V do not depend on the cache dtype)."""
    from splitserve.cli import main

    text = tmp_path / "traffic.txt"
    text.write_text("The invoice #4471 is due on 2026-12-01. Please pay 1,250.00 EUR. " * 8)
    out = tmp_path / "text.json"
    base = ["--device", "cpu", "--kv-cache-dtype", "int8", "--max-model-len", "64"]
    assert main(["kv-scales", "--out", str(out), "--text", str(text), "--chunk-tokens", "32",
                 *base]) == 0
    doc = json.loads(out.read_text())
    assert doc["calibration"]["tokens"] > 64 and doc["kv_cache_dtype"] == "int8"
    runner = smollm2.engine.runner
    cfg = runner.model_config
    scales, factors = load_kv_scales(out, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                     cfg.head_dim)
    ids = smollm2.engine.tokenizer.encode(text.read_text())  # type: ignore[union-attr]
    channels = torch.stack([runner.measure_kv_amax(ids[i:i + 32])
                            for i in range(0, len(ids), 32)]).amax(0)
    assert factors is not None and torch.equal(factors, channel_factors(channels))
    amax = layer_amax(channels)
    assert torch.all(scales * INT8_KV_MAX >= amax)
    assert torch.all(scales * INT8_KV_MAX <= amax * (1 + 1 / 8))


def test_prefill_logits_are_the_engines_teacher_forced_logits(
        tiny_model_dirs: dict[str, Path]) -> None:
    """`ModelRunner.prefill_logits` (tools/probes/probe_accuracy.py) is the engine's own forward:
    one prefill over a scratch cache gives every position's logits as the scheduled engine
    computes them (the float cache exactly; int8 reading back its own quantized K/V)."""
    tokens = [(5 * i + 2) % 384 for i in range(24)]
    for dtype, tol in (("auto", 1e-5), ("int8", 1e-5)):
        engine = _int8_llm(tiny_model_dirs["llama"]).engine if dtype == "int8" else tiny_llm(
            tiny_model_dirs["llama"], max_model_len=64).engine
        got = engine.runner.prefill_logits(tokens)
        engine.add_request("r", tokens, greedy(1))
        want = run_to_end(engine)["r"].logits_matrix()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
