"""Device identity: a GPU always named with its index."""

from __future__ import annotations

import torch


def indexed_device(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" is this process's current GPU. Tensors report
    "cuda:0", and a bare "cuda" compares unequal to it (every same-GPU IPC pull once fell back
    to kernels on the step stream for that)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())
