"""Qwen3 on the fast path: the q/k norms give RoPE + KV write (one fused Triton kernel) new
contiguous q and k instead of views of the fused QKV output, and run as Triton RMSNorm kernels.
Under TRITON_INTERPRET on the CPU (small shapes), the Triton path's logits match the torch path's,
which tests/unit/engine/test_model_vs_hf.py checks against `transformers` (on the GPU: HOPPER runs of the
same test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.layers import RMSNorm
from tests.support.engine_driver import assert_backends_agree, traces_by_backend
from tests.support.interpret import interpret_or_skip, interpreted_kernels

K = interpreted_kernels()
from engine.kernels import norm as norm_module  # noqa: E402 - loaded (interpreted) above


@pytest.fixture()
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_or_skip(monkeypatch, norm_module._rms_norm_kernel)


@pytest.mark.usefixtures("_interpret")
def test_qwen3_triton_path_matches_torch_path(tiny_model_dirs: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = RMSNorm.forward

    def spy(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None) -> object:
        calls.append((x.shape[-1], int(self.use_triton)))
        return real(self, x, residual)

    monkeypatch.setattr(RMSNorm, "forward", spy)
    # A chunked prompt, a short one beside its decodes, and a prefix hit's tail.
    prompts = {"a": [5, 17, 99, 3, 250, 7, 42, 8, 300], "b": [9, 8, 7],
               "again": [5, 17, 99, 3, 250, 7, 42, 8, 11, 12]}
    traces = traces_by_backend(tiny_model_dirs["qwen3"], prompts, max_num_batched_tokens=6,
                               max_model_len=32)
    # The per-head norms ran (head_dim 32, not the hidden size 64), as Triton kernels on that path.
    assert (32, 1) in calls and (32, 0) in calls
    assert set(traces["torch"]) == set(prompts)
    assert_backends_agree(traces, tol=1e-4, same_tokens=True)
