"""The batch-1 GEMV kernels (plain and fused with SiLU-and-mul) vs torch, and the model layers
that dispatch to them (TRITON_INTERPRET=1, CPU, small shapes)."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted_kernel_imports

# Importing test_kernels turns the interpreter on for the kernel modules; `_interpret` is its
# autouse fixture (re-exported so that it applies to this module's tests too).
from test_kernels import _interpret  # noqa: F401

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
    assert gemv_mod.choose_gemv_tiles(6144, 4096, False) == gemv_mod.GemvTiles(8, 256, 4, 3)
    assert gemv_mod.choose_gemv_tiles(4096, 4096, False) == gemv_mod.GemvTiles(8, 512, 4, 3)
    assert gemv_mod.choose_gemv_tiles(4096, 14336, False) == gemv_mod.GemvTiles(8, 512, 8, 3)
    assert gemv_mod.choose_gemv_tiles(14336, 4096, True) == gemv_mod.GemvTiles(8, 256, 4, 4)
    assert gemv_mod.choose_gemv_tiles(64, 48, False).block_k == 64  # never wider than K


@pytest.mark.parametrize("with_bias", [False, True])
def test_model_layers_dispatch_one_row_to_gemv(with_bias: bool) -> None:
    """`Linear` and `LlamaMLP` with use_gemv give the torch result for one row (through the
    GEMV) and for several rows (through cuBLAS/torch), from the same weights."""
    from types import SimpleNamespace

    from engine.model.layers import Linear
    from engine.model.llama import LlamaMLP

    torch.manual_seed(0)
    fast, plain = Linear(48, 40, with_bias, use_gemv=True), Linear(48, 40, with_bias)
    plain.load_state_dict(fast.state_dict())
    cfg = SimpleNamespace(hidden_size=48, intermediate_size=24, mlp_bias=with_bias)
    mlp_fast = LlamaMLP(cfg, use_triton=True, use_gemv=True)  # type: ignore[arg-type]
    mlp_plain = LlamaMLP(cfg, use_triton=False)  # type: ignore[arg-type]
    assert mlp_fast.use_gemv and not mlp_plain.use_gemv
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
    assert not gemv_enabled()
    monkeypatch.setenv("SPLITSERVE_GEMV", "1")
    assert gemv_enabled()
    monkeypatch.setenv("SPLITSERVE_GEMV", "yes")
    with pytest.raises(ConfigError, match="0 or 1"):
        gemv_enabled()
