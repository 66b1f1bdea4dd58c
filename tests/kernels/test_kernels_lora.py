"""The LoRA expand kernel (engine/kernels/lora.py) under the Triton interpreter: each row gets
exactly its own adapter's columns of h times B — against an independent per-row loop and
against the torch path of `LoRAStack.apply` (mask, multiply, addmm) it replaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.interpret import interpret_or_skip, interpreted_kernel_imports

with interpreted_kernel_imports():
    from engine.kernels import lora as lora_mod
    from engine.kernels._checks import KernelInputError
    from engine.kernels.lora import lora_expand


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    interpret_or_skip(monkeypatch, lora_mod._lora_expand_kernel)
    yield


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _layout(widths: list[int]) -> torch.Tensor:
    """col_slot for adapters of these widths, slot 1 first (width 0: a slot with no columns)."""
    return torch.cat([torch.full((w,), s, dtype=torch.long) for s, w in enumerate(widths, 1)])


def _naive(h: torch.Tensor, b: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor,
           y: torch.Tensor) -> torch.Tensor:
    out = y.double().clone()
    for t in range(h.shape[0]):
        own = cols == slots[t]
        out[t] += h[t, own].double() @ b[own].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_each_row_gets_its_own_adapter(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    cols = _layout([8, 24, 0, 40])  # C = 72: a tile edge inside slot 4
    n_out = 200  # not a multiple of the N tile
    h = torch.randn(rows, cols.numel(), generator=gen).to(dtype)
    b = (torch.randn(cols.numel(), n_out, generator=gen) * 0.1).to(dtype)
    slots = torch.randint(0, 5, (rows,), generator=gen)  # 0 (base) to 4; slot 3 owns nothing
    slots[0] = 2
    y = torch.randn(rows, n_out, generator=gen).to(dtype)
    want = _naive(h, b, cols, slots, y)
    # The torch path of LoRAStack.apply, for the same inputs.
    mask = (slots[:, None] == cols[None, :]).to(dtype)
    torch_path = y.clone().addmm_(h * mask, b)
    got = lora_expand(h, b, cols, slots, y.clone())
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    torch.testing.assert_close(got, torch_path, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    base = slots == 0
    assert torch.equal(got[base], y[base])  # rows of the base model untouched, exactly


def test_other_adapters_values_never_reach_a_row() -> None:
    """An inf or NaN in another adapter's columns: the torch mask turns it into NaN for every
    row (inf * 0); the kernel selects, so only that adapter's rows see it."""
    cols = _layout([4, 4])
    h = torch.ones(3, 8)
    h[:, 4] = float("inf")
    h[:, 5] = float("nan")
    b = torch.ones(8, 16)
    slots = torch.tensor([1, 0, 2])
    got = lora_expand(h, b, cols, slots, torch.zeros(3, 16))
    assert torch.equal(got[0], torch.full((16,), 4.0)) and torch.equal(got[1], torch.zeros(16))
    assert not torch.isfinite(got[2]).any()


def test_strided_rows_and_a_view_of_y() -> None:
    """h and y as column slices of wider buffers (their leading strides padded)."""
    gen = torch.Generator().manual_seed(3)
    cols = _layout([5, 11])
    wide_h = torch.randn(6, 40, generator=gen)
    h = wide_h[:, 3:19]
    b = torch.randn(16, 33, generator=gen)
    slots = torch.tensor([1, 2, 0, 2, 1, 1])
    wide_y = torch.randn(6, 50, generator=gen)
    y = wide_y[:, 10:43]
    want = _naive(h, b, cols, slots, y)
    lora_expand(h, b, cols, slots, y)
    torch.testing.assert_close(wide_y[:, 10:43].double(), want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_named() -> None:
    cols = _layout([4])
    h, b, y = torch.zeros(2, 4), torch.zeros(4, 8), torch.zeros(2, 8)
    slots = torch.tensor([1, 0])
    with pytest.raises(KernelInputError, match="share C"):
        lora_expand(h, torch.zeros(5, 8), cols, slots, y)
    with pytest.raises(KernelInputError, match=r"y \(2, 7\) must be \[T, N\]"):
        lora_expand(h, b, cols, slots, torch.zeros(2, 7))
    with pytest.raises(KernelInputError, match="token_slots"):
        lora_expand(h, b, cols, slots.int(), y)
    with pytest.raises(KernelInputError, match="b_all"):
        lora_expand(h, b.half(), cols, slots, y)
    with pytest.raises(KernelInputError, match="dense"):
        lora_expand(h, b, cols, slots, torch.zeros(8, 2).T)


def test_the_stack_through_the_kernel_equals_its_torch_path() -> None:
    """`LoRAStack.apply` with and without the kernel, for every fused projection of a tiny
    model's slotted stack holding two adapters (and a base-model row)."""
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from engine.config import ModelConfig
    from engine.lora import LoRABatch, LoRAStack, load_adapter
    from engine.lora.adapter import TARGETS
    from engine.lora.stack import FUSED_PARTS
    from tools.gpu.gpu_lora_check import write_adapter

    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    with TemporaryDirectory() as tmp:
        write_adapter(Path(tmp) / "a", cfg, TARGETS, 4, 8, seed=1)
        write_adapter(Path(tmp) / "b", cfg, ("q_proj", "down_proj"), 8, 8, seed=2)
        adapters = [load_adapter(n, str(Path(tmp) / n), cfg, 8) for n in ("a", "b")]
    stacks = [LoRAStack(adapters, cfg, torch.device("cpu"), torch.float32, max_loras=3,
                        max_rank=8, use_kernel=k) for k in (False, True)]
    batch = LoRABatch(torch.tensor([1, 0, 2, 2, 1]))
    gen = torch.Generator().manual_seed(0)
    for fused in FUSED_PARTS:
        a_all, b_all, _ = stacks[0].weights[1][fused]  # type: ignore[misc]
        x = torch.randn(5, a_all.shape[0], generator=gen)
        y = torch.randn(5, b_all.shape[1], generator=gen)
        outs = [s.apply(1, fused, x, y.clone(), LoRABatch(batch.token_slots)) for s in stacks]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5, msg=fused)
        assert not torch.equal(outs[0], y)  # the adapters did something
