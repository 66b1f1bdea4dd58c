"""Device identity (a GPU always named with its index) and small host lists on a device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def indexed_device(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" is this process's current GPU. Tensors report
    "cuda:0", and a bare "cuda" compares unequal to it (every same-GPU IPC pull once fell back
    to kernels on the step stream for that)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device.

    `torch.tensor(values, device="cuda")` copies from pageable memory as a blocking copy, which
    synchronizes the stream: the host then waits for the whole forward pass queued before it,
    and async scheduling loses its overlap for that step. From pinned memory the copy is
    queued like the rest (the caching host allocator keeps the buffer until it is done)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
