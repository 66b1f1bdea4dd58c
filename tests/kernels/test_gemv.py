"""The batch-1 GEMV kernels (plain and fused with SiLU-and-mul) vs torch, and the model layers
that dispatch to them (TRITON_INTERPRET=1, CPU, small shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from tests.kernels.test_kernels import _interpret  # noqa: F401
from tests.support.engine_driver import Trace, greedy, run_to_end, tiny_llm
from tests.support.interpret import interpreted_kernel_imports

with interpreted_kernel_imports():
    from engine.kernels import gemv as gemv_mod
    from engine.kernels._checks import KernelInputError


_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (24, 200), (5, 7), (40, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float64(dtype: torch.dtype, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    # A padded row stride: a view of a wider weight, as a fused parameter's slice would be.
    w = torch.randn(n, k + 3, generator=g).to(dtype)[:, :k]
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype)
    got = gemv_mod.gemv(x, w, b, out=out)
    assert got is out
    want = _ref_linear(x, w, b)
    tol = _TOL[dtype] * (1 + k ** 0.5)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("inter", "k"), [(16, 64), (12, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_silu_and_mul_matches_float64(dtype: torch.dtype, inter: int, k: int,
                                           with_bias: bool) -> None:
    g = torch.Generator().manual_seed(inter + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(2 * inter, k, generator=g).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype) if with_bias else None
    got = gemv_mod.gemv_silu_and_mul(x, w, b)
    gu = _ref_linear(x, w, b)
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert got.shape == (1, inter) and got.dtype == dtype
    tol = _TOL[dtype] * (1 + k ** 0.5) * 4
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=_TOL[dtype] * 4)


def _ref_rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 RMSNorm of `x + residual` (no rounding between the norm and the matmul)."""
    h = x.double() if residual is None else x.double() + residual.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g.double(), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_rms_norm_gemv_matches_float64(dtype: torch.dtype, n: int, k: int, with_residual: bool,
                                       gated: bool) -> None:
    g = torch.Generator().manual_seed(n * 7 + k + 3 * with_residual + gated)
    x = torch.randn(1, k, generator=g).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype) if with_residual else None
    res_before = None if res is None else res.clone()
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    rows = 2 * n if gated else n
    w = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(rows, generator=g).to(dtype)
    eps = 1e-5
    got, new_res = gemv_mod.rms_norm_gemv(x, norm_w, eps, w, b, residual=res, gated=gated)
    a, h = _ref_rms_norm(x, norm_w, eps, res)
    y = _ref_linear(a, w, b)
    want = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if gated else y
    assert got.shape == (1, n) and got.dtype == dtype
    tol = _TOL[dtype] * (1 + k ** 0.5) * (4 if gated else 1)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=_TOL[dtype] * 4)
    # The new residual is x + residual rounded once to x's dtype (the interpreter's bf16
    # rounding may differ from torch's by one ulp); inputs are untouched.
    ulp = 0.0 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(new_res, h.to(dtype), atol=0, rtol=ulp)
    if res is None:
        assert new_res is x
    else:
        assert new_res.data_ptr() != res.data_ptr()
        assert res_before is not None and torch.equal(res, res_before)


def test_rms_norm_gemv_rejects_bad_inputs() -> None:
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(KernelInputError, match="norm_weight"):
        gemv_mod.rms_norm_gemv(x, torch.ones(9), 1e-5, w)
    with pytest.raises(KernelInputError, match="eps"):
        gemv_mod.rms_norm_gemv(x, torch.ones(8), 0.0, w)
    with pytest.raises(KernelInputError, match="residual"):
        gemv_mod.rms_norm_gemv(x, torch.ones(8), 1e-5, w, residual=torch.randn(1, 9))
    with pytest.raises(KernelInputError, match="residual"):
        gemv_mod.rms_norm_gemv(x, torch.ones(8), 1e-5, w,
                               residual=torch.randn(1, 8, dtype=torch.float16))
    with pytest.raises(KernelInputError, match=r"\[2\*I, K\]"):
        gemv_mod.rms_norm_gemv(x, torch.ones(8), 1e-5, torch.randn(5, 8), gated=True)


def _fp8_operands(rows: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A bf16 row and weight quantized as W8A8 quantizes them: (xq, x_scale, wq, w_scale)."""
    from engine.kernels.reference import per_token_quant_fp8_ref

    g = torch.Generator().manual_seed(seed)
    xq, x_scale = per_token_quant_fp8_ref(torch.randn(1, k, generator=g).to(torch.bfloat16))
    wq, w_scale = per_token_quant_fp8_ref(torch.randn(rows, k, generator=g).to(torch.bfloat16))
    return xq, x_scale, wq, w_scale[:, 0].contiguous()


@pytest.mark.parametrize(("n", "k"), [(16, 64), (24, 200), (40, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_fp8_w8a8_matches_scaled_mm(n: int, k: int, with_bias: bool) -> None:
    """fp8 W8A8 at one row: the e4m3 row and weight with their scales give what
    `torch._scaled_mm` (Fp8Linear's many-row path) gives, to the bf16 output's rounding; the
    float64 product of the dequantized operands is the same number."""
    xq, x_scale, wq, w_scale = _fp8_operands(n, k, n * 7 + k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) \
        if with_bias else None
    got = gemv_mod.gemv(xq, wq, b, weight_scale=w_scale, x_scale=x_scale,
                        out_dtype=torch.bfloat16)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    want = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()[:, None]).T
    if b is not None:
        want = want + b.double()
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    mm = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale[None, :],
                          out_dtype=torch.bfloat16)
    if b is not None:
        mm = mm + b
    torch.testing.assert_close(got.float(), mm.float(), atol=2e-2, rtol=1.6e-2)


def test_gemv_silu_and_mul_fp8_w8a8() -> None:
    inter, k = 12, 96
    xq, x_scale, wq, w_scale = _fp8_operands(2 * inter, k, 3)
    got = gemv_mod.gemv_silu_and_mul(xq, wq, weight_scale=w_scale, x_scale=x_scale,
                                     out_dtype=torch.float32)
    gu = (xq.double() * x_scale.double()) @ (wq.double() * w_scale.double()[:, None]).T
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_gemv_fp8_rejects_bad_inputs() -> None:
    xq, x_scale, wq, w_scale = _fp8_operands(8, 32, 1)
    with pytest.raises(KernelInputError, match="out_dtype"):
        gemv_mod.gemv(xq, wq, weight_scale=w_scale, x_scale=x_scale)
    with pytest.raises(KernelInputError, match="needs fp8 weights"):
        gemv_mod.gemv(xq, wq, x_scale=x_scale, out_dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="one float32"):
        gemv_mod.gemv(xq, wq, weight_scale=w_scale, x_scale=torch.ones(2),
                      out_dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="dtype"):  # an int8 weight under an fp8 x
        gemv_mod.gemv(xq, wq.view(torch.int8), weight_scale=w_scale, x_scale=x_scale,
                      out_dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="only an fp8 x"):
        gemv_mod.gemv(torch.randn(1, 32), torch.randn(8, 32), out_dtype=torch.bfloat16)


def test_fp8_linear_one_row_through_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Fp8Linear` on the Triton path sends one row to the GEMV (and more rows to
    `_scaled_mm`); both give the torch path's W8A8 result."""
    from engine.model.quant import Fp8Linear

    calls: list[int] = []
    real = gemv_mod.gemv

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gemv_mod, "gemv", spy)
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    fast, plain = Fp8Linear(base, use_triton=True), Fp8Linear(base, use_triton=False)
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            torch.testing.assert_close(fast(x).float(), plain(x).float(), atol=3e-2, rtol=2e-2)
    assert len(calls) == 1  # the one-row call only
    monkeypatch.setenv("SPLITSERVE_GEMV", "0")
    assert Fp8Linear(base, use_triton=True)._gemv is None


def test_gemv_rejects_bad_inputs() -> None:
    x = torch.randn(1, 8)
    with pytest.raises(KernelInputError, match="one row"):
        gemv_mod.gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(KernelInputError, match="weight must be"):
        gemv_mod.gemv(x, torch.randn(4, 9))
    with pytest.raises(KernelInputError, match="dtype"):
        gemv_mod.gemv(x, torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(KernelInputError, match="bias"):
        gemv_mod.gemv(x, torch.randn(4, 8), torch.randn(5))
    with pytest.raises(KernelInputError, match=r"\[2\*I, K\]"):
        gemv_mod.gemv_silu_and_mul(x, torch.randn(5, 8))
    with pytest.raises(KernelInputError):
        gemv_mod.gemv(x, torch.randn(8, 4).T)  # not dense along K


def test_tiles_cover_llama_shapes_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU tile choice is the measured one (probe on the H200) for the Llama-3.1-8B shapes."""
    monkeypatch.setattr(gemv_mod, "interpret_mode", lambda: False)
    best = gemv_mod.GemvTiles(4, 1024, 4, 4)  # probe_gemv_sweep_9ee8372.json
    for n, k, gated in ((6144, 4096, False), (4096, 4096, False), (4096, 14336, False),
                        (14336, 4096, True)):
        assert gemv_mod.choose_gemv_tiles(n, k, gated) == best
    assert gemv_mod.choose_gemv_tiles(64, 48, False).block_k == 64  # never wider than K


@pytest.mark.parametrize("with_bias", [False, True])
def test_model_layers_dispatch_one_row_to_gemv(with_bias: bool) -> None:
    """`Linear` and `LlamaMLP` with use_gemv give the torch result for one row (through the
    GEMV) and for several rows (through cuBLAS/torch), from the same weights."""
    from types import SimpleNamespace

    from engine.model.decoder import LlamaMLP
    from engine.model.layers import Linear

    torch.manual_seed(0)
    fast, plain = Linear(48, 40, with_bias, use_gemv=True), Linear(48, 40, with_bias)
    cfg = SimpleNamespace(hidden_size=48, intermediate_size=24, mlp_bias=with_bias,
                          hidden_act="silu")
    mlp_fast = LlamaMLP(cfg, use_triton=True, use_gemv=True)  # type: ignore[arg-type]
    mlp_plain = LlamaMLP(cfg, use_triton=False)  # type: ignore[arg-type]
    assert mlp_fast.use_gemv and not mlp_plain.use_gemv
    with torch.no_grad():  # `Linear` leaves its parameters uninitialised (a model loads them)
        for p in (*fast.parameters(), *mlp_fast.parameters()):
            p.normal_(0.0, 0.2)
    plain.load_state_dict(fast.state_dict())
    mlp_plain.load_state_dict(mlp_fast.state_dict())
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 48)
            torch.testing.assert_close(fast(x), plain(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mlp_fast(x), mlp_plain(x), atol=1e-5, rtol=1e-5)


def test_gemv_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.config import ConfigError
    from engine.model.layers import gemv_enabled

    monkeypatch.delenv("SPLITSERVE_GEMV", raising=False)
    assert gemv_enabled()
    monkeypatch.setenv("SPLITSERVE_GEMV", "0")
    assert not gemv_enabled()
    monkeypatch.setenv("SPLITSERVE_GEMV", "1")
    assert gemv_enabled()
    monkeypatch.setenv("SPLITSERVE_GEMV", "yes")
    with pytest.raises(ConfigError, match="0 or 1"):
        gemv_enabled()


def test_engine_batch1_fused_norm_gemv_matches_torch_backend(
        tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone request's decode steps run every RMSNorm folded into the next GEMV
    (`SPLITSERVE_GEMV=1`, Triton backend): its logits at every position match the torch
    reference backend's, and the fused kernel really ran."""
    calls: list[bool] = []
    fused = gemv_mod.rms_norm_gemv

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(bool(kwargs.get("gated")))
        return fused(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gemv_mod, "rms_norm_gemv", spy)
    prompt = [5, 17, 99, 3, 250, 7]
    traces: dict[str, Trace] = {}
    for backend, gemv_flag in (("torch", "0"), ("triton", "1")):
        monkeypatch.setenv("SPLITSERVE_GEMV", gemv_flag)
        llm = tiny_llm(tiny_model_dirs["llama"], attention_backend=backend, max_model_len=32)
        llm.engine.add_request("a", prompt, greedy(4))
        traces[backend] = run_to_end(llm.engine)["a"]
    # 3 decode steps x 2 layers x (attention + MLP) blocks, half of them gated
    layers = 2
    assert len(calls) == 3 * layers * 2 and sum(calls) == 3 * layers
    got, want = traces["triton"], traces["torch"]
    torch.testing.assert_close(got.logits_matrix(), want.logits_matrix(), atol=1e-4, rtol=1e-4)
    assert got.request.output_token_ids == want.request.output_token_ids


def test_pdl_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL is on by default, refuses unknown values, and never applies off CUDA."""
    from engine.config import ConfigError
    from engine.kernels._pdl import pdl_requested, use_pdl

    try:
        monkeypatch.delenv("SPLITSERVE_PDL", raising=False)
        pdl_requested.cache_clear()
        assert pdl_requested()
        assert not use_pdl(torch.device("cpu"))
        monkeypatch.setenv("SPLITSERVE_PDL", "0")
        pdl_requested.cache_clear()
        assert not pdl_requested()
        monkeypatch.setenv("SPLITSERVE_PDL", "on")
        pdl_requested.cache_clear()
        with pytest.raises(ConfigError, match="0 or 1"):
            pdl_requested()
    finally:
        pdl_requested.cache_clear()
