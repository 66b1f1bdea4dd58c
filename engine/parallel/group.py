"""The tensor-parallel process group of this process, and the all-reduce the model calls.

One group per process (torch.distributed's default group), as in vLLM: an engine with
`tensor_parallel_size > 1` owns it from start to `shutdown`, and a second such engine in the
same process is refused while the first lives. Gloo on CPUs, NCCL on GPUs.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.distributed as dist

from engine.config import ConfigError

_lock = threading.Lock()
_owner: object | None = None  # what holds this process's group (its engine's driver)


def rendezvous(rank: int, size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The group's key-value store on 127.0.0.1:`port`: rank 0 serves it (port 0: any free
    port, read back from `store.port`), the others connect. Only local ranks join."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def joined_key(rank: int) -> str:
    """The key a worker sets in the store once it is about to join the group: rank 0 waits
    for every worker's (watching the processes) before it joins itself."""
    return f"splitserve/joined/{rank}"


def one_device_check() -> bool:
    """`SPLITSERVE_TP_ONE_DEVICE=1`: every rank on rank 0's GPU, the group on Gloo — to check
    the split's numerics on a host with one GPU (NCCL refuses two ranks on one device). Slow
    (collectives through the host); never for serving."""
    return os.environ.get("SPLITSERVE_TP_ONE_DEVICE", "0") == "1"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" and not one_device_check() else "gloo"


def init_group(owner: object, rank: int, size: int, store: dist.Store, device: torch.device,
               timeout_s: float) -> None:
    """Join the group of `size` ranks meeting at `store` (blocks until all have)."""
    global _owner
    with _lock:
        if _owner is not None or dist.is_initialized():
            raise ConfigError("this process already holds a tensor-parallel group (one "
                              "tensor-parallel engine per process; shut the other down first)")
        _owner = owner
    try:
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                # binds NCCL to this rank's GPU at once
                                device_id=device if backend_for(device) == "nccl" else None)
    except BaseException:
        with _lock:
            _owner = None
        raise


def destroy_group(owner: object) -> None:
    """Leave the group `owner` created (no-op when it holds none)."""
    global _owner
    with _lock:
        if _owner is not owner:
            return
        _owner = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (the row-parallel projections' partial products)."""
    dist.all_reduce(x)
    return x
