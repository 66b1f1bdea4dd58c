"""Gemma 2 / 3 beyond tests/unit/engine/test_model_vs_hf.py (the whole models against `transformers` on the
torch path): the GELU-tanh kernels against torch (TRITON_INTERPRET=1, CPU), Gemma's RMSNorm
(1 + w kept in float32 whatever the model dtype, equal to transformers' bf16 norm), the Triton
path's logits against the torch path's (windowed and soft-capped attention, the batch-1 GEMV
with GELU), the dummy preset, and Gemma 3's multimodal checkpoints served text-only (their
language model's weights under both name layouts, a tied or untied head, the vision tower's
skipped; tests/unit/engine/test_model_vs_hf.py compares the whole model with transformers'
Gemma3ForConditionalGeneration). Gemma's GGUF files are refused in tests/unit/engine/test_loader.py."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration, PreTrainedModel
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

from engine.config import LoadConfig
from engine.kernels import reference as R
from engine.llm import LLM
from engine.loader import ModelLoadError, load_model_source
from engine.loader.source import expected_weight_names
from engine.model.decoder import LlamaAttention
from engine.model.layers import GemmaRMSNorm
from engine.model.llama import MissingWeightsError
from tests.support.engine_driver import (
    assert_backends_agree,
    greedy,
    run_to_end,
    tiny_llm,
    traces_by_backend,
)
from tests.support.interpret import (
    interpret_or_skip,
    interpreted_kernel_imports,
    interpreted_kernels,
)

K = interpreted_kernels()
with interpreted_kernel_imports():
    from engine.kernels import activation as activation_module
    from engine.kernels import gemv as gemv_module


@pytest.fixture()
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_or_skip(monkeypatch, activation_module._act_and_mul_kernel)


# GELU-tanh's exp(-2z) overflows to inf for very negative gates, on purpose (x / inf = -0); the
# interpreter's numpy says so.
_EXP_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _gelu_mul(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_pytorch_tanh` gate times up, in float64."""
    gate, up = x.double().chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


@_EXP_OVERFLOW
@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(5, 2 * 40, generator=g))
    # Where exp overflows (very negative gates), near 0, and large: no NaN, torch's values.
    x[0, :8] = torch.tensor([-100.0, -30.0, -10.0, -1e-4, 0.0, 1e-4, 30.0, 100.0])
    x = x.to(dtype)
    got, ref = K.gelu_tanh_and_mul(x), R.gelu_tanh_and_mul_ref(x)
    assert got.dtype == dtype and got.shape == (5, 40) and not got.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(ref.double(), _gelu_mul(x).to(dtype).double(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _gelu_mul(x), atol=tol, rtol=tol)


@_EXP_OVERFLOW
@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gemv_gelu_matches_float64(dtype: torch.dtype) -> None:
    """The batch-1 fold of Gemma's pre-feedforward norm: x + residual normalised, times a
    float32 (1 + w), into the gate/up weight, GELU-tanh(gate) * up."""
    g = torch.Generator().manual_seed(5)
    k, inter = 64, 24
    x, res = (torch.randn(1, k, generator=g).to(dtype) for _ in range(2))
    norm_w = 1 + 0.1 * torch.randn(k, generator=g)  # float32 whatever x's dtype
    w = torch.randn(2 * inter, k, generator=g).to(dtype)
    got, new_res = gemv_module.rms_norm_gemv(x, norm_w, 1e-6, w, residual=res, gated=True,
                                             activation="gelu_pytorch_tanh")
    h = x.double() + res.double()
    a = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    want = _gelu_mul(a @ w.double().T)
    tol = (1e-5 if dtype == torch.float32 else 1.6e-2) * 4 * (1 + k ** 0.5)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert new_res.dtype == dtype
    with pytest.raises(K.KernelInputError, match="activation"):
        gemv_module.rms_norm_gemv(x, norm_w, 1e-6, w, gated=True, activation="relu")


@pytest.mark.usefixtures("_interpret")
def test_head_norm_of_a_lone_kv_head() -> None:
    """Gemma-3-1B has one KV head: k sliced from the fused QKV output and reshaped stays a
    strided view, which the Triton norm (q/k norms) must get dense."""
    qkv = torch.randn(5, 4 * 16 + 2 * 16)
    k = qkv[:, 64:80].reshape(-1, 1, 16)
    assert not k.reshape(5, 16).is_contiguous()
    fused, plain = GemmaRMSNorm(16, 1e-6, use_triton=True), GemmaRMSNorm(16, 1e-6)
    torch.testing.assert_close(LlamaAttention._head_norm(fused, k),
                               LlamaAttention._head_norm(plain, k), atol=1e-6, rtol=1e-6)


def test_gemma_norm_keeps_one_plus_w_in_float32() -> None:
    """Stored as 1 + w in float32 through `.to(bf16)`: the norm of a bf16 row is bit for bit
    transformers' Gemma2RMSNorm over the bf16 checkpoint weight w."""
    g = torch.Generator().manual_seed(1)
    w = (0.05 * torch.randn(48, generator=g)).to(torch.bfloat16)  # w near 0: 1 + w needs fp32
    ours = GemmaRMSNorm(48, 1e-6)
    ours.weight.data.copy_(GemmaRMSNorm.stored_weight(w))
    ours.to(torch.bfloat16)
    assert ours.weight.dtype == torch.float32
    hf = Gemma2RMSNorm(48, eps=1e-6).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    x, r = (torch.randn(3, 48, generator=g).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))
        out, new_r = ours(x, r)  # type: ignore[misc]
        assert torch.equal(out, hf(x + r)) and torch.equal(new_r, x + r)


@pytest.mark.usefixtures("_interpret")
def test_triton_gemma_norm_rounds_once_like_transformers() -> None:
    """The Triton norm of a Gemma layer multiplies x / rms(x) by 1 + w in float32 and rounds
    once: a bf16 row's result is transformers' Gemma2RMSNorm's up to a last-bit difference of
    the kernel's own rstd; the Llama order (rounding x / rms(x) first) is farther from it.
    (Without a residual: the fused add normalises the float32 sum, as vLLM's does, where
    transformers normalises the sum rounded to bf16.)"""
    g = torch.Generator().manual_seed(3)
    w = (0.3 * torch.randn(256, generator=g)).to(torch.bfloat16)
    hf = Gemma2RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    ours = GemmaRMSNorm(256, 1e-6, use_triton=True)
    ours.weight.data.copy_(GemmaRMSNorm.stored_weight(w))
    with torch.no_grad():
        want = hf(x).float()
        out = ours(x)
        twice = K.rms_norm(x, ours.weight, 1e-6, round_before_weight=True)
    assert isinstance(out, torch.Tensor) and isinstance(twice, torch.Tensor)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-3)
    err_once, err_twice = (out.float() - want).abs(), (twice.float() - want).abs()
    assert (err_once <= ulp).all()  # within one bf16 step everywhere
    # (Triton's interpreter rounds float32 to bf16 toward zero, so here one rounding still
    # differs from transformers' in about half the elements; compiled, only where the two sums
    # of squares differ: `gpu_kernels_check.py --only elementwise`, check rms_norm_gemma.)
    assert err_once.mean() < 0.75 * err_twice.mean()


def test_bf16_engine_keeps_gemma_norms_float32(
        tiny_model_dirs: dict[str, Path], hf_reference: Callable[[str], PreTrainedModel]) -> None:
    """A bf16 engine: its Gemma norms (Gemma 3's q/k norms too) stay float32, the rest bf16;
    its logits are as close to transformers' float32 ones as transformers' own bf16 model's."""
    path, prompt = tiny_model_dirs["gemma3"], [5, 17, 99, 3, 250, 7, 42, 8, 300]
    llm = tiny_llm(path, dtype="bfloat16", max_model_len=32)
    model = llm.engine.runner.model
    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert len(norms) == 2 * 6 + 1 and all(n.weight.dtype == torch.float32 for n in norms)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    llm.engine.add_request("a", prompt, greedy(1))
    ours = run_to_end(llm.engine)["a"].logits_matrix()
    hf_bf16 = Gemma3ForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf_reference("gemma3")(torch.tensor([prompt])).logits[0]
        theirs = hf_bf16(torch.tensor([prompt])).logits[0].float()
    gap = (theirs - want).abs().max().item()
    assert 0 < (ours - want).abs().max().item() <= 2 * gap


@pytest.mark.usefixtures("_interpret")
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_triton_path_matches_torch_path(tiny_model_dirs: dict[str, Path],
                                        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A prompt longer than the window, in chunks, then decodes of one row: windowed (and for
    Gemma 2 soft-capped) attention kernels, Triton norms with the float32 (1 + w), GELU-tanh,
    and each one-row MLP's norm folded into the gate/up GEMV with GELU."""
    activations: list[object] = []
    fused = gemv_module.rms_norm_gemv

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if kwargs.get("gated"):
            activations.append(kwargs.get("activation"))
        return fused(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gemv_module, "rms_norm_gemv", spy)
    prompts = {"a": [5, 17, 99, 3, 250, 7, 42, 8, 300]}
    traces = traces_by_backend(tiny_model_dirs[name], prompts, max_tokens=3,
                               max_num_batched_tokens=4, max_model_len=32)
    assert activations and set(activations) == {"gelu_pytorch_tanh"}
    assert_backends_agree(traces, tol=1e-4, same_tokens=True)


def test_dummy_tiny_gemma_generates() -> None:
    llm = LLM(model="dummy:tiny-gemma", device="cpu", dtype="float32", max_model_len=128,
              num_gpu_blocks=64)
    cfg = llm.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and [cfg.layer_window(i) for i in (0, 1)] == [
        64, 0]
    out = llm.generate([{"prompt_token_ids": list(range(1, 80))}], greedy(4))
    assert len(out[0].outputs[0].token_ids) == 4


# ---- Gemma 3's multimodal checkpoints, text only ------------------------------------------

Tensors = dict[str, torch.Tensor]
# transformers 4.52-4.57's names for what the original saves (and transformers 5's) hold at
# language_model.model.*, language_model.lm_head.*, vision_tower.*, multi_modal_projector.*.
_NEWER_LAYOUT = (("language_model.model.", "model.language_model."),
                 ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                 ("multi_modal_projector.", "model.multi_modal_projector."))


def _newer_name(name: str) -> str:
    for old, new in _NEWER_LAYOUT:
        if name.startswith(old):
            return new + name[len(old):]
    raise AssertionError(f"{name}: not a Gemma3ForConditionalGeneration tensor")


def _edited_copy(src: Path, dst: Path, edit: Callable[[Tensors], Tensors],
                 **config: Any) -> Path:
    """A copy of HF directory `src` with its tensors edited and `config` set in config.json."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    save_file(edit(load_file(weights)), weights, metadata={"format": "pt"})
    path = dst / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


def test_gemma3_multimodal_streams_its_language_model_alone(
        tiny_model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The vision tower and projector are skipped (and said to be), the rest is the text-only
    model's names, each once, the tied head absent."""
    path = tiny_model_dirs["gemma3mm"]
    names = set(load_file(path / "model.safetensors"))
    assert any(n.startswith("vision_tower.") for n in names)
    with caplog.at_level(logging.INFO, logger="engine.loader.hf"):
        source = load_model_source(LoadConfig(model=str(path)))
    assert "vision tower and multimodal projector are not loaded" in caplog.text
    cfg = source.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    assert source.weights is not None
    streamed = [name for name, _ in source.weights()]
    assert sorted(streamed) == sorted(expected_weight_names(cfg))


def test_gemma3_multimodal_newer_layout_and_untied_head(
        tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """transformers 4.52-4.57's names (model.language_model.*, a top-level lm_head) and a head
    of its own, untied by the wrapper's key alone: every position's logits are what
    transformers computes from the same file."""
    head = 0.15 * torch.randn(384, 64, generator=torch.Generator().manual_seed(7))

    def newer_untied(tensors: Tensors) -> Tensors:
        return {**{_newer_name(n): t for n, t in tensors.items()}, "lm_head.weight": head}

    path = _edited_copy(tiny_model_dirs["gemma3mm"], tmp_path / "newer", newer_untied,
                        tie_word_embeddings=False)
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    assert torch.equal(hf.lm_head.weight, head)  # transformers read the file's head too
    llm = tiny_llm(path, max_model_len=32)
    assert llm.engine.runner.model.lm_head is not None
    llm.engine.add_request("a", [5, 17, 99, 3, 250, 7, 42, 8, 300], greedy(3))
    trace = run_to_end(llm.engine)["a"]
    with torch.no_grad():
        want = hf(torch.tensor([trace.request.all_token_ids[:-1]])).logits[0]
    torch.testing.assert_close(trace.logits_matrix(), want, atol=1e-4, rtol=1e-4)


def test_gemma3_multimodal_missing_weight_is_named(tiny_model_dirs: dict[str, Path],
                                                   tmp_path: Path) -> None:
    gone = "language_model.model.layers.1.mlp.down_proj.weight"
    path = _edited_copy(tiny_model_dirs["gemma3mm"], tmp_path / "missing",
                        lambda tensors: {n: t for n, t in tensors.items() if n != gone})
    with pytest.raises(ModelLoadError, match=r"Gemma3ForConditionalGeneration's language "
                       r"model\): missing tensors: model\.layers\.1\.mlp\.down_proj\.weight$"):
        load_model_source(LoadConfig(model=str(path)))


def test_gemma3_multimodal_unknown_tensors_are_refused(tiny_model_dirs: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """Only the vision tower and the projector are skipped: a tensor the language model has no
    place for, or another modality's, is still unexpected."""
    extra = {"language_model.model.layers.0.mlp.gate.weight": torch.zeros(2),
             "audio_tower.conv.weight": torch.zeros(2)}
    path = _edited_copy(tiny_model_dirs["gemma3mm"], tmp_path / "extra",
                        lambda tensors: {**tensors, **extra})
    with pytest.raises(MissingWeightsError, match="unexpected weights") as e:
        tiny_llm(path, max_model_len=32)
    assert "model.layers.0.mlp.gate.weight" in str(e.value)
    assert "audio_tower.conv.weight" in str(e.value)
