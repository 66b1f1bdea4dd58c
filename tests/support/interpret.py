"""Triton kernels under the interpreter on the CPU (TRITON_INTERPRET=1): Triton decides at
decoration time whether a kernel is interpreted, so kernel modules must be imported with the
variable set, and tests that launch kernels run with it set."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest


def interpret_or_skip(monkeypatch: pytest.MonkeyPatch, kernel: object) -> None:
    """Run this test's Triton kernels under the interpreter; skip it when `kernel` (one of the
    module's, imported through `interpreted_kernel_imports`) was compiled for a GPU because
    another module imported the kernels first with the interpreter off."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if type(kernel).__name__ != "InterpretedFunction":
        pytest.skip("kernels were compiled for a GPU before this module set TRITON_INTERPRET")


@contextlib.contextmanager
def interpreted_kernel_imports() -> Iterator[None]:
    """Kernel modules imported inside see TRITON_INTERPRET=1 (Triton decides at decoration time
    whether a kernel is interpreted); the variable is restored after, so other test modules do
    not see a "GPU". Skips the importing module when Triton is not installed."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="Triton is not installed")
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def interpreted_kernels() -> ModuleType:
    """`engine.kernels` with every kernel module loaded now under the interpreter (they load
    lazily: a module first touched later, with the interpreter off, would compile for a GPU)."""
    with interpreted_kernel_imports():
        from engine import kernels

        for name in kernels.__all__:
            getattr(kernels, name)
    return kernels

