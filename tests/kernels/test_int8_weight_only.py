"""INT8 weight-only quantization (`--quantization int8`, engine/model/quant.py): the quantizer,
the Triton kernels that read int8 weights (batch-1 GEMV, with and without the fused RMSNorm, and
the W8A16 matmul) against float64 products of the same int8 values, and the engine end to end
(TRITON_INTERPRET=1, CPU, small shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from tests.kernels.test_kernels import _interpret  # noqa: F401
from tests.support.engine_driver import greedy, run_to_end, tiny_llm
from tests.support.interpret import interpreted_kernel_imports

with interpreted_kernel_imports():
    from engine.kernels import gemv as gemv_mod
    from engine.kernels import w8a16 as w8a16_mod
    from engine.kernels._checks import KernelInputError

from engine.model.quant import Int8Linear, quantize_weight_int8


def _int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, scale = quantize_weight_int8(w)
    return w, q, scale


def _exact(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ q.double().T * scale.double()
    return y if bias is None else y + bias.double()


def test_quantize_weight_int8_rounds_per_row() -> None:
    w, q, scale = _int8_weight(6, 40, 0)
    w[3] = 0.0
    q, scale = quantize_weight_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert int(q.abs().max()) == 127  # each nonzero row uses the whole range
    assert torch.equal(q[3], torch.zeros(40, dtype=torch.int8)) and scale[3] == 1.0
    # Round to nearest: every element within half a step of its row's grid.
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (5, 100)])
def test_int8_gemv_matches_the_exact_product(dtype: torch.dtype, n: int, k: int) -> None:
    _, q, scale = _int8_weight(n, k, n + k)
    x = torch.randn(1, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    got = gemv_mod.gemv(x, q, bias, weight_scale=scale)
    want = _exact(x, q, scale, bias)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)


def test_int8_gemv_reads_every_byte_value_exactly() -> None:
    """The GEMV's int8 -> float conversion (`Int8Cvt.MAGIC` under the interpreter: the byte
    biased into a float's mantissa) is exact for all 256 values, -128 and 127 included: with a
    one-hot activation each output is one weight times its scale."""
    values = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    q = values.view(4, 64)  # 4 rows of 64 weights: every byte value once
    scale = torch.tensor([1.0, 0.5, 2.0, 0.25])
    for col in range(64):
        x = torch.zeros(1, 64)
        x[0, col] = 1.0
        got = gemv_mod.gemv(x, q, weight_scale=scale)
        assert torch.equal(got[0], q[:, col].float() * scale)


@pytest.mark.parametrize("gated", [False, True])
def test_int8_fused_norm_gemv_matches_the_exact_product(gated: bool) -> None:
    n, k = 12, 48
    _, q, scale = _int8_weight(2 * n if gated else n, k, 7 + gated)
    x, res = torch.randn(1, k), torch.randn(1, k)
    norm_w = 1 + 0.1 * torch.randn(k)
    got, new_res = gemv_mod.rms_norm_gemv(x, norm_w, 1e-5, q, residual=res, gated=gated,
                                          weight_scale=scale)
    h = x.double() + res.double()
    a = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    y = _exact(a, q, scale)
    want = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if gated else y
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res, h.float(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(3, 20, 40), (17, 33, 50), (32, 16, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a16_matmul_matches_the_exact_product(dtype: torch.dtype, m: int, n: int, k: int,
                                               with_bias: bool) -> None:
    _, q, scale = _int8_weight(n, k, m * n + k)
    # A padded row stride on both operands, as views of wider tensors would have.
    x = torch.randn(m, k + 5).to(dtype)[:, :k]
    qv = torch.cat([q, torch.zeros(n, 3, dtype=torch.int8)], dim=1)[:, :k]
    bias = torch.randn(n).to(dtype) if with_bias else None
    got = w8a16_mod.w8a16_matmul(x, qv, scale, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    want = _exact(x, q, scale, bias)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_int8_rounds_each_product_once(dtype: torch.dtype) -> None:
    """Every byte value times its row's scale, formed in float32 and rounded once to dtype;
    the weight a padded-stride view."""
    q = torch.arange(-128, 128, dtype=torch.int8).repeat(6, 1)[:, torch.randperm(256)]
    q = torch.cat([q, torch.zeros(6, 7, dtype=torch.int8)], dim=1)[:, :250]
    scale = torch.rand(6) * 0.01 + 1e-4
    got = w8a16_mod.dequantize_int8(q, scale, dtype)
    assert got.shape == (6, 250) and got.dtype == dtype and got.is_contiguous()
    want = (q.float() * scale[:, None]).to(dtype)
    if dtype == torch.bfloat16:
        # The interpreter narrows float32 to bf16 by truncation, the GPU to nearest
        # (tools/gpu/gpu_kernels_check.py checks it bitwise there): at most one bf16 step apart.
        step = want.float().abs() * 2.0 ** -7
        assert bool(((got.float() - want.float()).abs() <= step).all())
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [3, 9])
def test_w8a16_linear_takes_the_widened_weight_from_dequant_min_rows(
        monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    monkeypatch.setattr(w8a16_mod, "DEQUANT_MIN_ROWS", 8)
    _, q, scale = _int8_weight(24, 40, rows)
    x = torch.randn(rows, 40).to(torch.bfloat16)
    bias = torch.randn(24)  # float32 bias on a bf16 input: cast to x's dtype
    got = w8a16_mod.w8a16_linear(x, q, scale, bias)
    if rows >= 8:
        want = torch.nn.functional.linear(
            x, w8a16_mod.dequantize_int8(q, scale, torch.bfloat16), bias.to(torch.bfloat16))
    else:
        want = w8a16_mod.w8a16_matmul(x, q, scale, bias)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), _exact(x, q, scale, bias.to(torch.bfloat16)),
                               atol=6.4e-2, rtol=1.6e-2)


def test_int8_kernels_reject_bad_inputs() -> None:
    _, q, scale = _int8_weight(8, 16, 1)
    x = torch.randn(2, 16)
    with pytest.raises(KernelInputError, match="int8"):
        w8a16_mod.w8a16_matmul(x, q.float(), scale)
    with pytest.raises(KernelInputError, match="weight_scale"):
        w8a16_mod.w8a16_matmul(x, q, scale[:4])
    with pytest.raises(KernelInputError, match="weight must be"):
        w8a16_mod.w8a16_matmul(torch.randn(2, 15), q, scale)
    with pytest.raises(KernelInputError, match="weight_scale"):
        gemv_mod.gemv(x[:1], q, weight_scale=scale.double())
    with pytest.raises(KernelInputError, match="dtype"):
        gemv_mod.gemv(x[:1], q)  # int8 weights need their scale
    with pytest.raises(KernelInputError, match="int8"):
        w8a16_mod.dequantize_int8(q.float(), scale, torch.bfloat16)
    with pytest.raises(KernelInputError, match="weight_scale"):
        w8a16_mod.dequantize_int8(q, scale[:4], torch.bfloat16)
    with pytest.raises(KernelInputError, match="dtype must be"):
        w8a16_mod.dequantize_int8(q, scale, torch.int32)


@pytest.mark.parametrize("use_triton", [False, True])
def test_int8_linear_is_the_product_of_its_int8_weights(use_triton: bool) -> None:
    linear = torch.nn.Linear(40, 24, bias=True)
    layer = Int8Linear(linear, use_triton)
    q, scale = quantize_weight_int8(linear.weight.detach())
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale)
    with torch.no_grad():
        for rows in (1, 5):  # the GEMV and the matmul on the Triton path
            x = torch.randn(rows, 40)
            want = _exact(x, q, scale, linear.bias.detach())
            torch.testing.assert_close(layer(x).double(), want, atol=1e-5, rtol=1e-5)
            # vs the float layer: int8 rounding only (~0.5% of a row's largest weight)
            assert (layer(x) - linear(x)).norm() / linear(x).norm() < 0.02


def test_engine_int8_triton_path_matches_torch_path_and_float_model(
        tiny_model_dirs: dict[str, Path]) -> None:
    """The whole engine with int8 weights: the Triton path (fused-norm GEMV at batch 1, W8A16
    matmul for prompts) against the torch path on the same int8 model, and both close to the
    unquantized model."""
    prompts = {"a": [5, 17, 99, 3, 250, 7]}  # interpreted Triton: one prompt, three decodes
    traces = {}
    for key, backend, quant in (("torch", "torch", "int8"), ("triton", "triton", "int8"),
                                ("float", "torch", "none")):
        llm = tiny_llm(tiny_model_dirs["llama"], attention_backend=backend, quantization=quant,
                       max_model_len=32)
        eng = llm.engine
        if quant == "int8":
            swapped = [m for m in eng.runner.model.modules() if isinstance(m, Int8Linear)]
            assert len(swapped) == 4 * eng.model_config.num_hidden_layers
        # One request at a time, so decode steps have one row (the GEMV path).
        traces[key] = {}
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, greedy(3))
            traces[key].update(run_to_end(eng))
    for rid, prompt in prompts.items():
        got, want = traces["triton"][rid], traces["torch"][rid]
        torch.testing.assert_close(got.logits_matrix(), want.logits_matrix(), atol=1e-4,
                                   rtol=1e-4, msg=rid)
        assert got.request.output_token_ids == want.request.output_token_ids
        plain = traces["float"][rid].logits_matrix()[:len(prompt)]
        quant = want.logits_matrix()[:len(prompt)]
        # int8 per-channel rounding: well under 5% over the tiny model's layers
        assert (quant - plain).norm() / plain.norm() < 0.05, rid
